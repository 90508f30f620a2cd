"""Which slice of every weight a rank holds under tensor parallelism, and which TP sizes a model allows.

Attention heads, the MLP width and the vocabulary are split evenly over the ranks. KV heads are split
too, or, when there are fewer KV heads than ranks, each KV head is replicated on tp / kv_heads ranks
(the ones whose query heads use it). The rules live here so the layers, the loader and the KV cache
can never disagree about a shard.
"""

from __future__ import annotations

from lockstep.model.config import ModelConfig


class TPConfigError(ValueError):
    """This tensor-parallel size cannot split this model."""


def _problems(config: ModelConfig, tp: int) -> list[str]:
    problems = []
    if config.num_heads % tp:
        problems.append(f"the attention heads ({config.num_heads})")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"the KV heads ({kv}) and is not a multiple of them")
    if config.intermediate_size % tp:
        problems.append(f"the MLP width ({config.intermediate_size})")
    if config.vocab_size % tp:
        problems.append(f"the vocabulary ({config.vocab_size})")
    return problems


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every TP size up to the number of attention heads that splits this model."""
    return [t for t in range(1, config.num_heads + 1) if not _problems(config, t)]


def check_tp_size(config: ModelConfig, tp: int) -> None:
    """Refuse a TP size before any weight is read, saying what does not divide and what would work."""
    if not isinstance(tp, int) or tp < 1:
        raise TPConfigError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    problems = _problems(config, tp)
    if problems:
        works = ", ".join(map(str, valid_tp_sizes(config)))
        raise TPConfigError(
            f"tensor-parallel size {tp} cannot split {config.architecture}: it does not divide "
            f"{', '.join(problems)}; TP sizes that work: {works}")


def shard(total: int, rank: int, tp: int) -> tuple[int, int]:
    """(start, length) of rank's even share of `total` rows."""
    size = total // tp
    return rank * size, size


def local_heads(config: ModelConfig, tp: int) -> int:
    return config.num_heads // tp


def local_kv_heads(config: ModelConfig, tp: int) -> int:
    """KV heads one rank holds: a share of them, or exactly one replicated head."""
    return max(1, config.num_kv_heads // tp)


def kv_head_start(config: ModelConfig, rank: int, tp: int) -> int:
    """First global KV head this rank holds; with replication, the head its query heads share."""
    if config.num_kv_heads >= tp:
        return rank * (config.num_kv_heads // tp)
    return rank // (tp // config.num_kv_heads)
