"""What both runs of the benchmark share: the prompts, the output length, the concurrency, the group."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from lockstep.coordinator.config import check_budget


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
    api_workers: int = 0  # the served run's HTTP API frontend processes (`--api-workers`); 0: in the coordinator
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # the served run's coordinator refuses less
        check_budget(self.max_num_batched_tokens, self.max_num_seqs, ("--max-num-batched-tokens", "--max-num-seqs"))


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    concurrency: int
    temperature: float = 0.0  # > 0: request i samples with seed i, so both runs draw the same tokens
    arrivals: tuple[float, ...] = ()  # seconds after the start before which request i is not sent; (): at once

    def wait_for(self, i: int, start: float) -> None:
        """Sleep until request i may be sent (`start` is the run's perf_counter at its start)."""
        if self.arrivals:
            time.sleep(max(0.0, start + self.arrivals[i] - time.perf_counter()))

    def arrived(self, i: int, start: float) -> bool:
        return not self.arrivals or time.perf_counter() - start >= self.arrivals[i]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> tuple[float, ...]:
    """When each of n requests arrives at `rate` requests/s on average, gaps exponential (a Poisson process, as
    vLLM's benchmark_serving --request-rate); an infinite rate sends them all at once: ()."""
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return ()
    rng = random.Random(f"arrivals/{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return tuple(out)


def sampling_of(workload: Workload, i: int) -> dict:
    """Request i's sampling fields, as the OpenAI API takes them."""
    return {"temperature": workload.temperature} | ({"seed": i} if workload.temperature else {})


def make_workload(requests: int, min_prompt: int, max_prompt: int, max_tokens: int, concurrency: int,
                  vocab: int, seed: int = 0, temperature: float = 0.0, request_rate: float = math.inf) -> Workload:
    """Random token prompts of mixed lengths; ids start at 3 to stay clear of the usual special tokens."""
    if vocab <= 3:
        raise ValueError(f"the tokenizer has {vocab} ids; the benchmark needs more than 3")
    rng = random.Random(seed)
    prompts = tuple(
        tuple(rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))) for _ in range(requests)
    )
    return Workload(prompts, max_tokens, concurrency, temperature, poisson_arrivals(requests, request_rate, seed))


def warmup_prompts(workload: Workload, n: int) -> list[tuple[int, ...]]:
    """Short prompts unrelated to the measured ones (reversed tokens), so they warm nothing in the cache."""
    return [tuple(reversed(workload.prompts[i % len(workload.prompts)][:16])) for i in range(n)]
