"""What both runs of the benchmark share: the prompts, the output length, the concurrency, the group."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    """What both runs share besides the workload."""

    tp: int = 2
    page_size: int = 16
    kv_pages: int = 512
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    prefix_caching: bool = True
    warmup: int = 2
    dtype: str = "auto"  # the ranks' weights and KV (`--dtype`), in both runs
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    concurrency: int
    temperature: float = 0.0  # > 0: request i samples with seed i, so both runs draw the same tokens


def sampling_of(workload: Workload, i: int) -> dict:
    """Request i's sampling fields, as the OpenAI API takes them."""
    return {"temperature": workload.temperature} | ({"seed": i} if workload.temperature else {})


def make_workload(requests: int, min_prompt: int, max_prompt: int, max_tokens: int, concurrency: int,
                  vocab: int, seed: int = 0, temperature: float = 0.0) -> Workload:
    """Random token prompts of mixed lengths; ids start at 3 to stay clear of the usual special tokens."""
    if vocab <= 3:
        raise ValueError(f"the tokenizer has {vocab} ids; the benchmark needs more than 3")
    rng = random.Random(seed)
    prompts = tuple(
        tuple(rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))) for _ in range(requests)
    )
    return Workload(prompts, max_tokens, concurrency, temperature)


def warmup_prompts(workload: Workload, n: int) -> list[tuple[int, ...]]:
    """Short prompts unrelated to the measured ones (reversed tokens), so they warm nothing in the cache."""
    return [tuple(reversed(workload.prompts[i % len(workload.prompts)][:16])) for i in range(n)]
