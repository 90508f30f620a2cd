"""A rank process for the control-plane benchmark: the real rank service around an engine with no model.

    python -m lockstep.bench.control_plane_rank --rank 0 --world-size 2 --port 50051 --stats rank0.json

It is `lockstep rank` (`rank.main.run`: the real RankServer, RankServicer and StepGate) with one thing
swapped: `NoopForwardEngine`, whose forward returns a token per sampling chunk without running a model.
Everything else a GPU rank does on the host per step is real: the plan's deserialization, the forward's inputs
(token ids, each pool's attention batch and its decode gathers), the RankCache's
releases, pins, allocations, commits and probe answers, the group's agreement all-reduce (over gloo at TP > 1
unless `--no-agreement`), the per-draw seeds of rows that draw, the report and its serialization. So the step time the
coordinator sees is the control plane's own, which on a GPU sits next to a forward of a few milliseconds.

This is a benchmark mode only: neither `lockstep rank` nor `lockstep serve` can select this engine, and a
rank started here says so in its log. On exit it writes its own per-step times (deserializing the plan,
serializing the report: the rank service does not record them) and its final RankCache state to `--stats`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lockstep.chunk_columns import ChunkColumns
from lockstep.engine import Ahead, Engine
from lockstep.kv.allocator import PagePool
from lockstep.kv.page_keys import key_salt
from lockstep.kv.paging import POOL_FULL
from lockstep.kv.rank_cache import RankCache
from lockstep.model.config import ModelConfig
from lockstep.model.draw_seeds import draw_seeds, seed_bases
from lockstep.model.kv_cache import KVCache
from lockstep.parallel.comm import Comm, init_comm, single_comm
from lockstep.rank import service
from lockstep.rank.main import RankConfig, run
from lockstep.steps import Plan, PromptLogprobs, Report, Sampled, SamplingParams

log = logging.getLogger("lockstep.bench.control_plane_rank")

MODEL_ID = "noop-forward"
FIRST_TOKEN = 3  # ids below are the usual special tokens (bos, eos, unk): never sampled, so no request stops early


def noop_model_config(world_size: int, vocab_size: int, max_model_len: int) -> ModelConfig:
    """A one-layer, one-wide "model" whose KV pages take a few bytes: what `Engine.__init__` and `info` read
    (positions, vocabulary, pool layout), with nothing to load or run."""
    return ModelConfig(architecture="LlamaForCausalLM", hidden_size=world_size, num_layers=1, num_heads=world_size,
                       num_kv_heads=world_size, head_dim=1, intermediate_size=world_size, vocab_size=vocab_size,
                       layer_types=("full_attention",), max_position_embeddings=max_model_len)


class NoopForwardEngine(Engine):
    """The serving `Engine` (its `__init__` and `step`: prepare, agreement, forward, advance, finish) with a forward
    that runs no model.

    Subclassing keeps the step protocol's host-side order exactly the serving engine's; only `_launch` and
    `_collect`, the forward and sampling, are replaced by a token per sampling chunk that only the request and
    its index decide (from its per-draw seed, `draw_seeds`, where the real sampler would derive one), so every
    rank returns the same id and none is EOS.
    `agreement=False` skips the group's all-reduce, to tell its cost from the rest at TP > 1.
    """

    def __init__(self, kv: KVCache, cache: RankCache, comm: Comm, config: ModelConfig, agreement: bool = True) -> None:
        super().__init__(None, kv, cache, comm, config, MODEL_ID)  # type: ignore[arg-type]  # no model: `_run` needs none
        self.agreement = agreement
        self.forward_s = 0.0  # `--forward-ms`: how long the forward takes (a sleep: the host waiting on its GPU)
        self.runs_ahead = False  # a "device" that computes while the host goes on: set with a forward that takes time
        self.began: dict[int, float] = {}  # perf_counter at which each step's engine work began, and ended
        self.ended: dict[int, float] = {}
        self.staged_steps: list[int] = []  # the steps prepared ahead, during the forward of the step before

    @classmethod
    def build(cls, rank: int, world_size: int, rendezvous: str, page_size: int, kv_pages: int, vocab_size: int,
              max_model_len: int, prefix_caching: bool = True, agreement: bool = True) -> NoopForwardEngine:
        """One full-attention pool of `kv_pages` pages; a gloo group at TP > 1 only when the agreement runs."""
        if world_size == 1:
            comm = single_comm()
        elif agreement:
            comm = init_comm(rank, world_size, rendezvous, "cpu", collective_timeout_s=60.0)
        else:
            comm = Comm(rank, world_size)  # never reduces: `_agree` is local without the agreement
        config = noop_model_config(world_size, vocab_size, max_model_len)
        kv = KVCache.create(config, world_size, kv_pages, page_size, torch.float16, "cpu")
        cache = RankCache({POOL_FULL: PagePool(POOL_FULL, kv_pages)}, page_size, key_salt(MODEL_ID, page_size),
                          max_model_len, prefix_caching, rank)
        return cls(kv, cache, comm, config, agreement)

    def step(self, plan: Plan, ahead: Ahead | None = None) -> Report:
        """The serving engine's step, timed from the rank's step thread: between two steps that thread waits for
        the next plan and does the rank service's bookkeeping, nothing else (`rank gap`)."""
        began = time.perf_counter()
        report = super().step(plan, ahead)
        self.began[plan.step], self.ended[plan.step] = began, time.perf_counter()
        return report

    def stage(self, plan: Plan) -> None:
        self.staged_steps.append(plan.step)
        super().stage(plan)

    def _pending_tokens(self, plan: Plan, error: str) -> tuple[list[int], str]:
        if self.agreement:
            return super()._pending_tokens(plan, error)
        b = ChunkColumns.of(plan.batch)
        pending = b.pending()
        return self._draws([b.request_ids[i] for i in pending], [b.sampling[i] for i in pending],
                           [b.sample_index[i] - 1 for i in pending]), error

    def _agree(self, step: int, error: str, drawn: list[int]) -> tuple[bool, list[int]]:
        return super()._agree(step, error, drawn) if self.agreement else (bool(error), drawn)

    def _draws(self, request_ids: Sequence[str], params: Sequence[SamplingParams], indexes: Sequence[int]
               ) -> list[int]:
        """Tokens only (request, index) decide, from the per-draw seeds the real sampler derives (`draw_seeds`): a
        request without a seed (a greedy one: the coordinator gives it none, the real sampler takes its argmax)
        from its id."""
        bases = seed_bases(request_ids, [p.seed for p in params])
        span = self.config.vocab_size - FIRST_TOKEN
        return [FIRST_TOKEN + seed % span for seed in draw_seeds(bases, indexes)]

    def _launch(self, batch: ChunkColumns, ids: torch.Tensor, attn: dict[str, Any]) -> float:
        """The forward begins on the "device": when it will be done (`forward_s` from now)."""
        return time.perf_counter() + self.forward_s

    def _busy(self, ready_at: float) -> Callable[[], float]:
        return lambda: max(0.0, ready_at - time.perf_counter())

    def _collect(self, batch: ChunkColumns, ready_at: float) -> tuple[tuple[Sampled, ...], tuple[PromptLogprobs, ...]]:
        """The forward's tokens, once it is done: waited for with the GIL free, as a CUDA sync waits; with
        `runs_ahead`, the host's work since `_launch` (this step's advance and finish, the next step's prepare and
        inputs) ran meanwhile, as on a GPU."""
        wait = ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        rows = [i for i, go in enumerate(batch.sample) if go]
        rids = [batch.request_ids[i] for i in rows]
        tokens = self._draws(rids, [batch.sampling[i] for i in rows], [batch.sample_index[i] for i in rows])
        return tuple(Sampled(rid, t) for rid, t in zip(rids, tokens, strict=True)), ()


class WireTimes:
    """The rank service's plan deserialization and report serialization, timed per step in this process only.

    The rank service records the engine's time and its own (`Timings`), not the protobuf conversions around
    them (its reader thread parses a plan, its handler encodes a report, both beside the step thread); wrapping
    the two names it calls, here, measures them without touching the serving code."""

    def __init__(self) -> None:
        self.plan_s: dict[int, float] = {}
        self.report_s: dict[int, float] = {}

    def install(self) -> None:
        service.plan_from_proto = self._timed(service.plan_from_proto, self.plan_s)
        service.report_to_proto = self._timed(service.report_to_proto, self.report_s, by_argument=True)

    @staticmethod
    def _timed(fn: Callable[[Any], Any], into: dict[int, float], by_argument: bool = False) -> Callable[[Any], Any]:
        def timed(obj: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(obj)
            into[(obj if by_argument else out).step] = time.perf_counter() - t0
            return out

        return timed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lockstep.bench.control_plane_rank",
                                description="A benchmark rank: the real rank service around a no-op forward.")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rendezvous", default="127.0.0.1:29500", help="host:port of rank 0's gloo store (TP > 1)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-agreement", action="store_true", help="skip the agreement all-reduce (TP > 1)")
    p.add_argument("--cpu", type=int, help="run on this core alone (the benchmark's --split-cores)")
    p.add_argument("--stats", type=Path, required=True, help="write the per-step wire times and final state here")
    p.add_argument("--forward-ms", type=float, default=0.0, help="the forward takes this long (a sleep, as on a GPU)")
    p.add_argument("--no-prepare-ahead", action="store_true",
                   help="with --forward-ms: wait for the forward where it begins (as on the CPU), preparing nothing "
                        "of the next step meanwhile")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    cfg = RankConfig(rank=args.rank, world_size=args.world_size, rendezvous=args.rendezvous, host="127.0.0.1",
                     port=args.port, model=MODEL_ID, page_size=args.page_size, kv_pages=args.kv_pages,
                     kv_memory_fraction=None, prefix_caching=not args.no_prefix_caching, threads=1)
    engines: list[NoopForwardEngine] = []

    def factory(c: RankConfig) -> NoopForwardEngine:
        log.warning("rank %d: BENCHMARK MODE: no model, a no-op forward (agreement %s)", c.rank,
                    "off" if args.no_agreement else "on")
        engines.append(NoopForwardEngine.build(c.rank, c.world_size, c.rendezvous, c.page_size, c.kv_pages,
                                               args.vocab_size, args.max_model_len, c.prefix_caching,
                                               not args.no_agreement))
        engines[0].forward_s = args.forward_ms / 1e3
        engines[0].runs_ahead = args.forward_ms > 0 and not args.no_prepare_ahead
        return engines[0]

    wire_times = WireTimes()
    wire_times.install()
    code = run(cfg, factory)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None  # Linux only
    state: dict[str, Any] = {"rank": args.rank, "exit": code, "plan_s": wire_times.plan_s,
                             "report_s": wire_times.report_s, "cpus": cpus}
    if engines:
        state["step_began"], state["step_ended"] = engines[0].began, engines[0].ended
        state["staged"] = engines[0].staged_steps
        cache = engines[0].cache
        try:
            cache.check()
            state["consistent"] = True
        except AssertionError as exc:
            state["consistent"] = str(exc)
        state["pools"] = [vars(p) for p in cache.stats()]
        state["requests_held"] = len(cache.pool.owners())
    args.stats.write_text(json.dumps(state))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
