"""How many concurrent requests of a 2k-token context fit in one KV budget, with hybrid pools (`full` and
`sliding`, split by `KVCache.split_budget`) against one pool that keeps every layer's whole context.

The real scheduler, admission control and per-rank bookkeeping (`RankCache`) run; only the forward is left
out (every sampled token is 1), so the numbers are the pages' doing, not the CPU's. The model is Gemma 3
270M's shape (18 layers, 15 of them sliding over 512 tokens, one KV head of 256, bf16).

    python scripts/bench_hybrid_pools.py [--budget-mib 256] [--requests 96] [--prompt 2000] [--decode 48]

With --shift it runs a workload that shifts (long prompts, then many short ones) with the rebalance off and
on, and prints the concurrency each phase reached, preemptions and decode tokens per step side by side.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from lockstep.coordinator.rebalance import RebalancePolicy, Rebalancer
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import Scheduler
from lockstep.kv.allocator import PagePool
from lockstep.kv.page_keys import key_salt
from lockstep.kv.paging import POOL_SLIDING
from lockstep.kv.rank_cache import RankCache
from lockstep.model.config import ModelConfig
from lockstep.model.kv_cache import KVCache
from lockstep.steps import Report, Sampled

GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "sliding_window": 512, "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True,
}
PS = 16


def pools_for(config: ModelConfig, budget: int, hybrid: bool) -> tuple[dict[str, int], int]:
    """(pages per pool, window) in `budget` bytes: the split, or every layer in one `full` pool."""
    if hybrid:
        return KVCache.split_budget(config, 1, PS, budget, torch.bfloat16), config.sliding_window
    return {"full": budget // KVCache.bytes_per_page(config, 1, PS, torch.bfloat16)}, 0


class Bench:
    """The scheduler over one rank's real bookkeeping; every sampled token is 1."""

    def __init__(self, pages: dict[str, int], window: int, args: argparse.Namespace,
                 rebalancer: Rebalancer | None = None) -> None:
        salt = key_salt("bench-hybrid", PS)
        self.cache = RankCache({n: PagePool(n, p) for n, p in pages.items()}, PS, salt, 1 << 20, True, 0, window)
        self.sched = Scheduler(PS, salt, args.max_num_batched_tokens, args.max_num_seqs, 1, True, None,
                               window=window, rebalancer=rebalancer)
        self.reports: list[Report] = []
        self.step = 0
        self.rng = random.Random(0)

    def add(self, n: int, prompt: int, decode: int) -> None:
        for _ in range(n):
            tokens = [self.rng.randrange(1, 50_000) for _ in range(prompt)]
            self.sched.add(Request(f"r{self.rng.getrandbits(48)}", tokens, max_tokens=decode))

    def drain(self, prompt: int) -> dict[str, float]:
        """Run until idle: the most requests decoding at once, and decode tokens per step."""
        peak = tokens = 0
        first, preempted = self.step, self.sched.stats.preemptions
        while self.sched.has_work():
            plan = self.sched.plan(self.step, self.reports, now=self.step * 0.05)
            self.cache.prepare(plan)
            for chunk in plan.batch:
                self.cache.advance(chunk)
            probes, states = self.cache.finish(plan)
            sampled = tuple(Sampled(c.request_id, 1) for c in plan.batch if c.sample)
            tokens += len(sampled)
            self.reports = [Report(self.step, 0, sampled, probes, states)]
            self.sched.apply(self.reports)
            peak = max(peak, sum(1 for r in self.sched.running if r.num_computed >= prompt))
            self.step += 1
        steps = self.step - first
        return {"peak_concurrent": peak, "preemptions": self.sched.stats.preemptions - preempted,
                "steps": steps, "tokens_per_step": tokens / max(1, steps),
                "pools": {n: p.num_pages for n, p in self.cache.pools.items()}}


def run(config: ModelConfig, budget: int, hybrid: bool, args: argparse.Namespace) -> dict[str, float]:
    pages, window = pools_for(config, budget, hybrid)
    bench = Bench(pages, window, args)
    bench.add(args.requests, args.prompt, args.decode)
    t0 = time.perf_counter()
    out = bench.drain(args.prompt)
    return {**out, "pages": pages, "wall_s": time.perf_counter() - t0}


def shift(config: ModelConfig, budget: int, args: argparse.Namespace) -> None:
    """Long prompts, then short ones, with the rebalance off and on: each phase side by side."""
    pages, window = pools_for(config, budget, True)
    cost = {p: KVCache.bytes_per_page(config, 1, PS, torch.bfloat16, p) for p in pages}
    policy = RebalancePolicy(interval_steps=10, cooldown_s=5.0, min_samples=32, threshold=1.25)
    phases = (("long", args.requests, args.prompt), ("short", 4 * args.requests, args.short_prompt))
    print(f"shifting workload: {args.requests} x {args.prompt} tokens, then {4 * args.requests} x "
          f"{args.short_prompt}, +{args.decode} each; rebalance every 10 steps, 5 s simulated cooldown "
          f"(a step is 50 ms), 32 samples, max model len {args.max_model_len}")
    for name, rebalancer in (("off", None), ("on", Rebalancer(policy, PS, window, cost, args.max_model_len))):
        bench = Bench(pages, window, args, rebalancer)
        for phase, n, prompt in phases:
            bench.add(n, prompt, args.decode)
            r = bench.drain(prompt)
            print(f"rebalance {name:3s} {phase:5s}: {r['peak_concurrent']:3d} at once, {r['preemptions']:4d} "
                  f"preemptions, {r['steps']:4d} steps, {r['tokens_per_step']:.2f} decode tokens/step, "
                  f"pools after {r['pools']}")
        print(f"rebalance {name:3s}: {bench.sched.rebalances} rebalances")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--shift", action="store_true", help="the shifting workload, rebalance off and on")
    parser.add_argument("--short-prompt", type=int, default=200)
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="the context the group serves: no pool shrinks below one request of it")
    args = parser.parse_args()
    config = ModelConfig.from_hf(GEMMA3_270M)
    budget = args.budget_mib << 20
    if args.shift:
        shift(config, budget, args)
        return
    print(f"Gemma 3 270M shape, KV budget {args.budget_mib} MiB bf16, page {PS} tokens, "
          f"{args.requests} requests of {args.prompt} + {args.decode} tokens, window {config.sliding_window}")
    results = {name: run(config, budget, hybrid, args) for name, hybrid in (("one pool", False), ("hybrid", True))}
    for name, r in results.items():
        print(f"{name:9s} pools {r['pages']}: {r['peak_concurrent']} requests at once in decode, "
              f"{r['preemptions']} preemptions, {r['steps']} steps ({r['wall_s']:.1f} s)")
    ratio = results["hybrid"]["peak_concurrent"] / max(1, results["one pool"]["peak_concurrent"])
    print(f"hybrid / one pool: {ratio:.2f}x concurrent requests; sliding pool named {POOL_SLIDING!r}")


if __name__ == "__main__":
    main()
