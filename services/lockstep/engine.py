"""The rank-side state machine: one plan in, one report out.

A rank never decides anything here. It carries out the coordinator's plan in the order of the step
protocol (releases, pins, allocations, forward, sampling, commits, flush, probes) and reports what
it holds. An operator's flush comes after the step's pins, so it never takes a prefix that the
plan's admits were agreed on, and the probes answer from the flushed state.

Whether the step can be carried out at all is agreed across the group before the forward: a rank
that must refuse (a prefix it does not hold, an allocation that cannot be met) still takes part in
that one small all-reduce, so no rank ever skips a collective that the others enter.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lockstep.device import pick_device
from lockstep.kv.allocator import OutOfPages, PagePool, PrefixNotHeld
from lockstep.kv.page_keys import key_salt, next_key
from lockstep.model.attention import AttentionBatch
from lockstep.model.config import ModelConfig
from lockstep.model.kv_cache import KVCache
from lockstep.model.llama import LlamaModel
from lockstep.model.loader import load_model
from lockstep.model.sampling import sample
from lockstep.parallel.comm import Comm, init_comm, single_comm
from lockstep.steps import Chunk, GroupBroken, Plan, ProbeAnswer, Report, Sampled

log = logging.getLogger("lockstep.engine")

POOL = "default"
DEFAULT_CPU_KV_BUDGET = 1 << 30


class StepRefused(RuntimeError):
    """This rank cannot carry out the plan; the whole group then skips the step together."""


@dataclass
class _Sequence:
    """What this rank holds of one request: positions [0, length) are in its pages."""

    cached: int
    length: int
    parent: bytes | None
    tokens: list[int] = field(default_factory=list)
    committed: int = 0


def sample_seed(request_id: str, seed: int | None, sample_index: int) -> int:
    """Per-draw seed every rank derives alike, so a recompute after preemption draws the same tokens."""
    base = f"{request_id}" if seed is None else f"seed:{seed}"
    digest = hashlib.blake2b(f"{base}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Engine:
    """One rank's shard of the model, its KV pages and its prefix index, driven by plans."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        pool: PagePool,
        comm: Comm,
        config: ModelConfig,
        page_size: int,
        salt: bytes,
        prefix_caching: bool = True,
        model_id: str = "",
    ) -> None:
        self.model = model
        self.kv = kv
        self.pool = pool
        self.comm = comm
        self.config = config
        self.page_size = page_size
        self.salt = salt
        self.prefix_caching = prefix_caching
        self.model_id = model_id
        self.device = kv.k[0].device
        self.seqs: dict[str, _Sequence] = {}
        self.last_plan: Plan | None = None
        self.last_report: Report | None = None

    @classmethod
    def create(
        cls,
        model_dir: str | Path,
        rank: int = 0,
        world_size: int = 1,
        rendezvous: str = "127.0.0.1:29500",
        page_size: int = 16,
        kv_pages: int = 0,
        prefix_caching: bool = True,
        kv_budget_bytes: int = 0,
        dtype: torch.dtype = torch.float32,
        kv_memory_fraction: float | None = None,
    ) -> Engine:
        if str(model_dir) == "builtin":
            from lockstep.model.builtin import ensure_builtin_model

            model_dir = ensure_builtin_model()
        device = pick_device(rank)
        comm = single_comm() if world_size == 1 else init_comm(rank, world_size, rendezvous, device)
        model = load_model(model_dir, comm, device, dtype)
        config = model.config
        if kv_pages <= 0:
            budget = kv_budget_bytes or _default_kv_budget(device, world_size, kv_memory_fraction)
            kv_pages = KVCache.pages_for_budget(config, world_size, page_size, budget, dtype)
        if kv_pages < 1:
            raise ValueError(f"the KV budget gives {kv_pages} pages of {page_size} tokens; give more memory")
        kv = KVCache.create(config, world_size, kv_pages, page_size, dtype, device)
        model_id = Path(model_dir).name
        return cls(
            model, kv, PagePool(POOL, kv_pages), comm, config, page_size,
            key_salt(model_id, page_size), prefix_caching, model_id,
        )

    def info(self) -> dict:
        return {
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "model_id": self.model_id,
            "page_size": self.page_size,
            "pools": {POOL: self.pool.stats().total},
            "max_model_len": self.config.max_position_embeddings,
            "vocab_size": self.config.vocab_size,
        }

    def step(self, plan: Plan) -> Report:
        """Carry out one plan. A repeated delivery of the last plan is answered, not executed again."""
        if self.last_report is not None and plan.step == self.last_report.step:
            if plan == self.last_plan:
                return self.last_report
            return Report(step=plan.step, rank=self.comm.rank, error=f"rank {self.comm.rank}: step {plan.step} "
                          "was already carried out with a different plan")
        t0 = time.perf_counter()
        report = Report(step=plan.step, rank=self.comm.rank)
        releases = list(self.pool.owners()) if plan.release_all else plan.releases
        for request_id in releases:
            self.pool.release(request_id)
            self.seqs.pop(request_id, None)
        error = self._prepare(plan)
        try:
            refused = self._group_refuses(error)
        except Exception as exc:
            raise GroupBroken(f"rank {self.comm.rank}: the agreement collective of step {plan.step} failed: "
                              f"{exc}") from exc
        if refused:
            for admit in plan.admits:
                self.pool.release(admit.request_id)
                self.seqs.pop(admit.request_id, None)
            report.error = error or "another rank of the group refused this step"
        elif plan.batch:
            t1 = time.perf_counter()
            try:
                report.sampled = self._run(plan.batch)
            except Exception as exc:
                if self.comm.world_size > 1:
                    raise GroupBroken(f"rank {self.comm.rank}: step {plan.step} failed inside the forward, where "
                                      f"its peers may be waiting in a collective: {exc}") from exc
                log.exception("rank 0: the forward of step %d failed", plan.step)
                report.error = f"rank 0: {type(exc).__name__} in the forward: {exc}"
            report.timings["forward_s"] = time.perf_counter() - t1
        if plan.flush_prefix_cache:
            self.pool.flush()
        report.probes = [self._probe(p.request_id, p.keys) for p in plan.probes]
        report.pools = [self.pool.stats()]
        report.timings["step_s"] = time.perf_counter() - t0
        self.last_plan, self.last_report = plan, report
        return report

    def _prepare(self, plan: Plan) -> str:
        """Pins and allocations of the step; returns why this rank refuses, or "" when it can go on."""
        try:
            for admit in plan.admits:
                if admit.request_id in self.seqs:
                    raise StepRefused(f"request {admit.request_id} is admitted twice")
                keys = admit.prefix_keys if self.prefix_caching else ()
                if admit.prefix_keys and not self.prefix_caching:
                    raise StepRefused(f"request {admit.request_id}: prefix caching is off on rank {self.comm.rank}")
                self.pool.pin(admit.request_id, keys)
                cached = len(keys) * self.page_size
                self.seqs[admit.request_id] = _Sequence(
                    cached=cached, length=cached, parent=keys[-1] if keys else None, committed=len(keys)
                )
            for chunk in plan.batch:
                self._reserve(chunk)
        except (PrefixNotHeld, OutOfPages, StepRefused, ValueError) as exc:
            return f"rank {self.comm.rank}: {exc}"
        except Exception as exc:  # a bug must still reach the agreement collective, or the peers hang in it
            log.exception("rank %d: preparing step %d failed", self.comm.rank, plan.step)
            return f"rank {self.comm.rank}: {type(exc).__name__} while preparing the step: {exc}"
        return ""

    def _reserve(self, chunk: Chunk) -> None:
        seq = self.seqs.get(chunk.request_id)
        if seq is None:
            raise StepRefused(f"request {chunk.request_id} is not admitted")
        if chunk.start != seq.length:
            raise StepRefused(
                f"request {chunk.request_id}: chunk starts at {chunk.start} but this rank holds {seq.length} tokens"
            )
        if not chunk.token_ids:
            raise StepRefused(f"request {chunk.request_id}: empty chunk")
        end = chunk.start + len(chunk.token_ids)
        if end > self.config.max_position_embeddings:
            raise StepRefused(f"request {chunk.request_id}: position {end} is past the model's context")
        need = -(-end // self.page_size) - len(self.pool.table(chunk.request_id))
        if need > 0:
            self.pool.allocate(chunk.request_id, need)

    def _group_refuses(self, error: str) -> bool:
        if self.comm.world_size == 1:
            return bool(error)
        flag = torch.tensor([1.0 if error else 0.0], device=self.device)
        return bool(self.comm.all_reduce(flag).item() > 0)

    def _run(self, batch: tuple[Chunk, ...]) -> list[Sampled]:
        spans = [(c.start, len(c.token_ids), self.pool.table(c.request_id)) for c in batch]
        ids = torch.tensor([t for c in batch for t in c.token_ids], dtype=torch.long, device=self.device)
        attn = AttentionBatch.build(spans, self.page_size, self.device)
        with torch.inference_mode():
            logits = self.model(ids, attn, self.kv)
        rows = [i for i, c in enumerate(batch) if c.sample]
        sampled: list[Sampled] = []
        if rows:
            chosen = [batch[i] for i in rows]
            tokens = sample(
                logits[rows],
                [c.sampling for c in chosen],
                [sample_seed(c.request_id, c.sampling.seed, c.sample_index) for c in chosen],
            )
            sampled = [Sampled(c.request_id, t) for c, t in zip(chosen, tokens, strict=True)]
        for chunk in batch:
            self._advance(chunk)
        return sampled

    def _advance(self, chunk: Chunk) -> None:
        """Record the chunk's tokens and commit the pages it filled into the index."""
        seq = self.seqs[chunk.request_id]
        seq.tokens.extend(chunk.token_ids)
        seq.length += len(chunk.token_ids)
        if not self.prefix_caching:
            return
        table = self.pool.table(chunk.request_id)
        full = seq.length // self.page_size
        for page_index in range(seq.committed, full):
            lo = page_index * self.page_size - seq.cached
            key = next_key(seq.parent, seq.tokens[lo : lo + self.page_size], self.salt)
            self.pool.commit(chunk.request_id, table[page_index], key)
            seq.parent = key
        seq.committed = max(seq.committed, full)

    def _probe(self, request_id: str, keys: tuple[bytes, ...]) -> ProbeAnswer:
        if not self.prefix_caching:
            return ProbeAnswer(request_id, 0, 0)
        matched, pinned = self.pool.probe(keys)
        return ProbeAnswer(request_id, matched, pinned)


def _default_kv_budget(device: torch.device, world_size: int, fraction: float | None) -> int:
    """Bytes for KV pages: a share of the free device memory left after the weights are loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (0.9 if fraction is None else fraction))
    if fraction is None:
        return DEFAULT_CPU_KV_BUDGET
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * fraction / world_size)
