"""Plain data of the step protocol: what a plan tells every rank and what a rank reports back.

These are the cores' types. The rank and coordinator services translate them to and from the
protobuf messages of `proto/` at their edges; nothing here imports torch, grpc or aiohttp, so the
coordinator's pure decisions and the engine share one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass(frozen=True)
class Admit:
    """Start holding a request: pin the first `len(prefix_keys)` pages of its chain.

    `prefix_keys` are the keys of the agreed prefix (L pages), computed by the coordinator; a rank
    that does not hold every one of them refuses the step instead of skipping a page.
    """

    request_id: str
    prefix_keys: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """Tokens of one request to run this step: a prefill chunk or one decode token.

    `start` is the position of the first token; the rank holds positions [0, start) already.
    `sample` asks for a token from the logits of the chunk's last position; `sample_index` is how
    many tokens the request has generated before this one (it seeds per-request sampling, so a
    recompute after preemption draws the same tokens).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    sample: bool = False
    sampling: SamplingParams = SamplingParams()
    sample_index: int = 0


@dataclass(frozen=True)
class Probe:
    """Ask how many leading pages of this chain a rank holds, and how many of those are pinned."""

    request_id: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class Plan:
    """Everything every rank does at one step, in the order of DESIGN.md's step protocol."""

    step: int
    releases: tuple[str, ...] = ()
    admits: tuple[Admit, ...] = ()
    batch: tuple[Chunk, ...] = ()
    probes: tuple[Probe, ...] = ()
    flush_prefix_cache: bool = False
    release_all: bool = False


@dataclass(frozen=True)
class ProbeAnswer:
    request_id: str
    matched_pages: int
    pinned_pages: int


@dataclass(frozen=True)
class PoolState:
    """One KV pool's page counts. free + evictable + used == total, always."""

    pool: str
    total: int
    free: int
    evictable: int
    used: int
    pinned: int = 0


@dataclass(frozen=True)
class Sampled:
    request_id: str
    token_id: int


@dataclass
class Report:
    """What one rank says after carrying out plan `step`. `error` set means the step was refused."""

    step: int
    rank: int
    sampled: list[Sampled] = field(default_factory=list)
    probes: list[ProbeAnswer] = field(default_factory=list)
    pools: list[PoolState] = field(default_factory=list)
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)


class GroupBroken(RuntimeError):
    """A collective failed: this rank no longer knows where its peers are, so it must not serve on.

    torch.distributed groups cannot take a new member, so the only way back is a new group: the rank
    reports this and exits, and the operator (or `lockstep serve`) recreates the group as a whole.
    """
