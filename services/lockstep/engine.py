"""The rank-side state machine: one plan in, one report out.

A rank never decides anything here. It carries out the coordinator's plan in the order of the step
protocol (releases, pins, allocations, forward, sampling, commits, flush, probes) and reports what
it holds. The page bookkeeping of that order (everything but the forward and sampling) is
`kv.rank_cache.RankCache`, torch-free, which the tests drive with a fake forward; an operator's
flush comes after the step's pins there, so it never takes a prefix that the plan's admits were
agreed on, and the probes answer from the flushed state. Which deliveries of a plan are carried out
at all (in order, once) is `steps.StepGate`'s, in the rank service and LocalGroup.

Whether the step can be carried out at all is agreed across the group before the forward: a rank
that must refuse (a prefix it does not hold, an allocation that cannot be met) still takes part in
that one small all-reduce, so no rank ever skips a collective that the others enter.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.chunk_columns import ChunkColumns
from lockstep.device import busy_probe, host_runs_ahead, pick_device, pick_dtype
from lockstep.engine_config import EngineConfig
from lockstep.kv.allocator import PagePool
from lockstep.kv.page_keys import key_salt
from lockstep.kv.paging import POOL_SLIDING, pool_window
from lockstep.kv.rank_cache import RankCache, StepRefused
from lockstep.model.attention_batch import AttentionBatch, long_tensor
from lockstep.model.config import ModelConfig
from lockstep.model.draw_seeds import row_seeds
from lockstep.model.kv_cache import KVCache
from lockstep.model.llama import LlamaModel
from lockstep.model.loader import load_model
from lockstep.model.penalties import PenaltyBook, RowPenalty, penalize
from lockstep.model.sampling import sample, token_logprobs
from lockstep.parallel.comm import Comm, init_comm, single_comm
from lockstep.steps import Chunk, GroupBroken, Plan, PromptLogprobs, RankInfo, Report, Sampled, Timings

log = logging.getLogger("lockstep.engine")

DEFAULT_CPU_KV_BUDGET = 1 << 30
# The rank whose tokens the coordinator uses; the others skip sampling (and penalties and logprobs): every rank
# holds the same logits, and the tokens come back to all of them in the next plan anyway.
SAMPLING_RANK = 0
# pending tokens (overlap) that ride in the agreement all-reduce itself; a batch with more sends the rest in a
# second one. 64 float64 slots add 512 bytes to a one-number collective: nothing next to its latency.
AGREEMENT_SLOTS = 64


Ahead = Callable[[Callable[[], float]], None]  # `Engine.step`'s hook, given the forward's probe
_Outcome = tuple[tuple[Sampled, ...], tuple[PromptLogprobs, ...], tuple[tuple, tuple] | None]


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A plan prepared ahead (`Engine.stage`): the object the service holds, as columns, why it is refused, and
    its attention batches when they could be built ahead."""

    source: Plan
    plan: Plan
    error: str
    attention: dict[str, AttentionBatch] | None


def _as_columns(plan: Plan) -> Plan:
    """The plan with its batch as columns, as read off the wire; one made here (tests, benchmarks) is converted."""
    if isinstance(plan.batch, ChunkColumns):
        return plan
    return dataclasses.replace(plan, batch=ChunkColumns.of(plan.batch))


class Engine:
    """One rank's shard of the model and its KV memory; the pages' bookkeeping is its RankCache."""

    def __init__(
        self, model: LlamaModel, kv: KVCache, cache: RankCache, comm: Comm, config: ModelConfig, model_id: str = ""
    ) -> None:
        self.model = model
        self.kv = kv
        self.cache = cache
        self.comm = comm
        self.config = config
        self.model_id = model_id
        self.device = kv.k[0].device
        self.penalties = PenaltyBook()  # token counts of the penalized requests this rank holds
        self.drawn: dict[str, int] = {}  # the sampling rank's tokens of its last step, for pending chunks
        self._tables: dict[str, tuple[object, torch.Tensor]] = {}  # each pool's block table, wrapped (_host_table)
        self._staged: _Staged | None = None
        # whether the host goes on while the device computes a forward (a CUDA stream): only then is there time to
        # prepare the next step during this one's forward
        self.runs_ahead = host_runs_ahead(self.device)
        self.page_bytes = {name: KVCache.bytes_per_page(config, comm.world_size, kv.page_size, kv.k[0].dtype, name)
                           for name in cache.pools}

    @classmethod
    def create(cls, cfg: EngineConfig) -> Engine:
        """Load the model shard of this rank, join its group and size the KV pool to the memory left."""
        model_dir = cfg.model
        if model_dir.startswith("builtin"):
            from lockstep.model.builtin import resolve_model

            model_dir = resolve_model(model_dir)
        device = pick_device(cfg.rank)
        dtype = pick_dtype(cfg.dtype, device, ModelConfig.checkpoint_dtype(model_dir))
        comm = single_comm() if cfg.world_size == 1 else init_comm(
            cfg.rank, cfg.world_size, cfg.rendezvous, device, collective_timeout_s=cfg.collective_timeout_s)
        model = load_model(model_dir, comm, device, dtype)
        config = model.config
        if cfg.kv_pages > 0:
            pages = dict.fromkeys(config.pool_names, cfg.kv_pages)
        else:
            budget = cfg.kv_budget_bytes or _default_kv_budget(device, cfg.world_size, cfg.kv_memory_fraction)
            pages = KVCache.split_budget(config, cfg.world_size, cfg.page_size, budget, dtype)
        if min(pages.values()) < 1:
            raise ValueError(f"the KV budget gives {pages} pages of {cfg.page_size} tokens; give more memory")
        kv = KVCache.create(config, cfg.world_size, pages, cfg.page_size, dtype, device)
        model_id = Path(model_dir).name
        cache = RankCache(
            {name: PagePool(name, n) for name, n in pages.items()}, cfg.page_size,
            key_salt(model_id, cfg.page_size), config.max_position_embeddings, cfg.prefix_caching, cfg.rank,
            window=config.sliding_window if POOL_SLIDING in pages else 0,
        )
        log.info("rank %d: %s on %s, KV pools %s pages of %d tokens", cfg.rank, str(dtype).removeprefix("torch."),
                 device, pages, cfg.page_size)
        return cls(model, kv, cache, comm, config, model_id)

    def info(self) -> RankInfo:
        """What this rank serves; its last step is the rank service's to tell, so it is left at -1 here."""
        return RankInfo(
            rank=self.comm.rank,
            world_size=self.comm.world_size,
            model_id=self.model_id,
            page_size=self.cache.page_size,
            pools=self.cache.totals(),
            max_model_len=self.config.max_position_embeddings,
            vocab_size=self.config.vocab_size,
            sliding_window=self.cache.window,
            page_bytes=tuple(self.page_bytes.items()),
        )

    def step(self, plan: Plan, ahead: Ahead | None = None) -> Report:
        """Carry out one plan in the order of the step protocol; the report is what this rank holds after it.

        `ahead` is called while the device runs this step's forward (`runs_ahead`), once this step's pages are
        advanced and its report's state taken, with a probe of the forward (`device.busy_probe`): the rank
        service waits there for the next plan while the forward runs, and hands it to `stage`."""
        t0 = time.perf_counter()
        staged, self._staged = self._staged, None
        if staged is not None:
            if staged.source is not plan:  # its prepare is done and cannot be taken back: a bug of the caller's
                raise GroupBroken(f"rank {self.comm.rank}: step {staged.plan.step} was prepared ahead, but step "
                                  f"{plan.step} came instead")
            plan = staged.plan
        else:
            plan = _as_columns(plan)
        if plan.release_all:
            self.penalties.clear()
        self.penalties.release(plan.releases)  # a released request is admitted again with its history
        error = staged.error if staged is not None else self._prepare(plan)
        drawn, error = self._pending_tokens(plan, error)
        self.drawn = {}  # taken: a step that raises (GroupBroken) leaves no token for a step prepared ahead of it
        refused, drawn = self._agree(plan.step, error, drawn)
        if refused:
            self.cache.undo_admits()
            error = error or "another rank of the group refused this step"
        elif plan.pool_split:
            self._resize(plan)
            log.info("rank %d: KV pools rebalanced at step %d to %s", self.comm.rank, plan.step, dict(plan.pool_split))
        elif plan.pool_fence:
            log.info("rank %d: KV pools fenced at step %d at %s", self.comm.rank, plan.step, dict(plan.pool_fence))
        sampled: tuple[Sampled, ...] = ()
        scored: tuple[PromptLogprobs, ...] = ()
        finished = None
        forward_s = 0.0
        if not error and plan.batch:
            t1 = time.perf_counter()
            attention = staged.attention if staged is not None else None
            (sampled, scored, finished), error = self._forward(plan, drawn, attention, ahead)
            forward_s = time.perf_counter() - t1
        self.drawn = {s.request_id: s.token_id for s in sampled} if self.comm.rank == SAMPLING_RANK else {}
        probes, pools = finished if finished is not None else self.cache.finish(plan)
        timings = Timings(step_s=time.perf_counter() - t0, forward_s=forward_s)
        return Report(plan.step, self.comm.rank, sampled, probes, pools, error, timings, scored)

    def stage(self, plan: Plan) -> None:
        """The next plan's host work, done while the device runs this step's forward (called from `ahead`):
        its RankCache prepare, in the same order after this step's advance and finish as without it, and its
        forward's attention batches (the token ids wait for the agreement's pending tokens). The plan counts as
        started from here: its prepare cannot be taken back, so `step` must get this very plan next."""
        staged = _as_columns(plan)
        error = self._prepare(staged)
        attention = None
        if not error and staged.batch and not (staged.pool_split or staged.pool_fence):
            try:
                attention = self._attention(staged.batch)
            except Exception:  # the step builds them again and fails where it would have
                log.debug("rank %d: the inputs of step %d could not be built ahead", self.comm.rank, plan.step,
                          exc_info=True)
        self._staged = _Staged(plan, staged, error, attention)

    def _prepare(self, plan: Plan) -> str:
        """RankCache's prepare of the plan; why this rank refuses the step, or ""."""
        try:
            self.cache.prepare(plan)
            return ""
        except StepRefused as exc:
            return str(exc)

    def _resize(self, plan: Plan) -> None:
        """The split the group agreed on, carried out on the KV tensors. The bookkeeping moved at `prepare` and
        the peers carry it out too, so a rank that cannot (out of memory: a layer's new tensor is made while the
        old one lives) has no consistent state left to report a refusal from: it breaks the group, which is
        made again from nothing."""
        try:
            self.kv.resize(self.config, dict(plan.pool_split))
        except Exception as exc:
            raise GroupBroken(f"rank {self.comm.rank}: the KV split agreed at step {plan.step} could not be carried "
                              f"out ({type(exc).__name__}: {exc})") from exc

    def _pending_tokens(self, plan: Plan, error: str) -> tuple[list[int], str]:
        """The sampling rank's tokens of the last step for the plan's pending chunks (overlap), in batch order,
        and the step's error: a pending token it did not draw (the last step was refused) refuses this one."""
        batch = ChunkColumns.of(plan.batch)
        rows = batch.pending()  # all of them at a decode step with overlap
        pending = batch.request_ids if len(rows) == len(batch) else [batch.request_ids[i] for i in rows]
        if not pending or self.comm.rank != SAMPLING_RANK:
            return [0] * len(pending), error
        tokens = [self.drawn.get(rid, -1) for rid in pending]  # a token id is never negative
        if min(tokens) < 0:
            missing = pending[tokens.index(-1)]
            if not error:
                error = f"rank {self.comm.rank}: no token drawn at step {plan.step - 1} for pending request {missing}"
            tokens = [max(t, 0) for t in tokens]
        return tokens, error

    def _agree(self, step: int, error: str, drawn: list[int]) -> tuple[bool, list[int]]:
        """Whether the group refuses the step, and the sampling rank's pending tokens (the other ranks add zeros,
        so the sum is its tokens, exact in float64).

        The collective has one shape on every rank whatever plan it carries out: the refusal flag and
        AGREEMENT_SLOTS token slots. A rank abstaining from a step whose plan the others got (a coordinator that
        died between its writes) still meets theirs. Tokens past the slots go in a second all-reduce that only
        ranks which all accepted the step, so carry out the same batch, join.
        """
        if self.comm.world_size == 1:
            return bool(error), drawn
        head, rest = drawn[:AGREEMENT_SLOTS], drawn[AGREEMENT_SLOTS:]
        slots = [1.0 if error else 0.0, *head] + [0.0] * (AGREEMENT_SLOTS - len(head))
        both = torch.tensor(slots, dtype=torch.float64, device=self.device)
        try:
            out = self.comm.all_reduce(both).tolist()
        except Exception as exc:
            raise GroupBroken(
                f"rank {self.comm.rank}: the agreement collective of step {step} failed: {exc}") from exc
        if out[0] > 0:
            return True, drawn
        shared = [int(t) for t in out[1:1 + len(head)]]
        if rest:
            try:
                more = self.comm.all_reduce(torch.tensor(rest, dtype=torch.float64, device=self.device)).tolist()
            except Exception as exc:
                raise GroupBroken(
                    f"rank {self.comm.rank}: sharing the pending tokens of step {step} failed: {exc}") from exc
            shared += [int(t) for t in more]
        return False, shared

    def _forward(self, plan: Plan, drawn: list[int], attention: dict[str, AttentionBatch] | None,
                 ahead: Ahead | None) -> tuple[_Outcome, str]:
        """((sampled tokens, prompt scores, the finished state or None), error). Alone, a failed forward is a
        refused step; in a group it breaks the group, since the peers may be waiting in one of its collectives."""
        try:
            return self._run(plan, drawn, attention, ahead), ""
        except GroupBroken:
            raise
        except Exception as exc:
            if self.comm.world_size > 1:
                raise GroupBroken(f"rank {self.comm.rank}: step {plan.step} failed inside the forward, where "
                                  f"its peers may be waiting in a collective: {exc}") from exc
            log.exception("rank 0: the forward of step %d failed", plan.step)
            return ((), (), None), f"rank 0: {type(exc).__name__} in the forward: {exc}"

    def _inputs(self, batch: ChunkColumns) -> tuple[torch.Tensor, dict[str, AttentionBatch]]:
        """The forward's token ids and each KV pool's attention batch: the host's share of a step."""
        return long_tensor(self.device, batch.token_ids), self._attention(batch)  # via an array: 3x torch.tensor's

    def _attention(self, batch: ChunkColumns) -> dict[str, AttentionBatch]:
        """Each KV pool's attention batch, read off the RankCache's block tables (one row per request, kept as its
        pages change): all of the forward's inputs but its token ids."""
        rows = self.cache.rows(batch.request_ids)
        batches = {name: AttentionBatch.from_table(self._host_table(name), rows, batch.starts, batch.token_counts,
                                                   self.cache.page_size, self.device)
                   for name in self.cache.pools}
        dtype = self.kv.k[0].dtype  # the queries'
        for name, batch in batches.items():  # here, not in the first layer: a GPU's copies stay out of the forward
            if batch.single_seqs:
                for group in batch.single_gathers(pool_window(name, self.cache.window)):
                    group.bias(dtype)
        return batches

    def _host_table(self, pool: str) -> torch.Tensor:
        """The pool's block table as a host tensor on its array (no copy), made again when the table grew."""
        table = self.cache.block_tables[pool]
        made = self._tables.get(pool)
        if made is None or made[0] is not table.data:
            made = self._tables[pool] = (table.data, torch.frombuffer(table.data, dtype=torch.int32).view(
                table.rows, table.cols))
        return made[1]

    def _run(self, plan: Plan, drawn: list[int], attention: dict[str, AttentionBatch] | None, ahead: Ahead | None
             ) -> _Outcome:
        """The forward and the sampling, with the pages advanced after them; where the host runs ahead of the
        device, advanced and finished while the device computes (then `ahead`), and the tokens taken last."""
        batch: ChunkColumns = plan.batch  # type: ignore[assignment]  # `step` made it columns
        batch = batch.resolved(drawn) if drawn else batch
        if attention is None:
            ids, attn = self._inputs(batch)
        else:  # built ahead: the token ids alone are left, now that the pending ones are known
            ids, attn = long_tensor(self.device, batch.token_ids), attention
        launched = self._launch(batch, ids, attn)
        if not self.runs_ahead:
            sampled, scored = self._collect(batch, launched)
            self.cache.advance_all(batch)
            return sampled, scored, None
        self.cache.advance_all(batch)
        finished = self.cache.finish(plan)
        try:  # the probe too: an event recorded after a device fault fails with it
            if ahead is not None:
                ahead(self._busy(launched))
            return *self._collect(batch, launched), finished
        except Exception as exc:  # the pages moved on already: the report could not say where the rank stands
            raise GroupBroken(f"rank {self.comm.rank}: step {plan.step} failed after its pages were advanced, "
                              f"taking the forward's results ({type(exc).__name__}: {exc})") from exc

    def _launch(self, batch: ChunkColumns, ids: torch.Tensor, attn: dict[str, AttentionBatch]) -> Any:
        """The forward, which a GPU runs while the host goes on: what `_collect` takes the tokens from."""
        return self._forward_and_score(batch, ids, attn)

    def _busy(self, launched: Any) -> Callable[[], float]:
        """The forward's probe: how long to wait before asking again whether it still runs, 0 once done."""
        return busy_probe(self.device)

    def _collect(self, batch: ChunkColumns, launched: Any) -> tuple[tuple[Sampled, ...], tuple[PromptLogprobs, ...]]:
        """The sampled tokens (the sampling rank's) and prompt scores of the forward `_launch` began."""
        logits, scored = launched
        rows = [i for i, s in enumerate(batch.sample) if s]
        sampled: tuple[Sampled, ...] = ()
        if rows and self.comm.rank == SAMPLING_RANK:
            rids, indexes = batch.request_ids, batch.sample_index
            params = [batch.sampling[i] for i in rows]
            tokens = sample(self._adjusted(batch, rows, logits), params, row_seeds(
                [rids[i] for i in rows], params, [indexes[i] for i in rows]))
            sampled = tuple(Sampled(rids[i], t) for i, t in zip(rows, tokens, strict=True))
            sampled = _with_logprobs(sampled, logits[rows], [p.logprobs for p in params])
        return sampled, scored

    def _adjusted(self, batch: ChunkColumns, rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits to draw from: with their penalties and biases (greedy included), from the
        token counts this rank keeps, which every chunk of a penalized request updates. Logprobs stay raw."""
        if not any(s.adjusts_logits for s in batch.distinct_sampling):
            return logits[rows]
        counts = {c.request_id: self.penalties.counts(c) for c in batch if c.sampling.needs_history}
        vocab = logits.shape[-1]
        adjust = [RowPenalty.of(batch[i].sampling, batch[i].sample_index, counts.get(batch[i].request_id), vocab)
                  for i in rows]
        if not any(a is not None for a in adjust):
            return logits[rows]
        return penalize(logits[rows], adjust)

    def _forward_and_score(self, batch: ChunkColumns, ids: torch.Tensor, attn: dict[str, AttentionBatch]
                           ) -> tuple[torch.Tensor, tuple[PromptLogprobs, ...]]:
        """(the logits of each chunk's last position, the prompt scores of the chunks that ask): the logits of
        every position of a chunk that scores its prompt, and only of the last position of the others."""
        if not any(prompt_logprobs >= 0 for prompt_logprobs, _, _ in batch.extras.values()):
            with torch.inference_mode():
                return self.model(ids, attn, self.kv), ()
        rows: list[int] = []
        lasts: list[int] = []
        firsts: list[int] = []  # where each chunk's rows start in the logits
        flat = 0
        for c in batch:
            n = len(c.token_ids)
            firsts.append(len(rows))
            rows.extend(range(flat, flat + n) if c.prompt_logprobs >= 0 else [flat + n - 1])
            lasts.append(len(rows) - 1)
            flat += n
        with torch.inference_mode():
            logits = self.model(ids, attn, self.kv, rows=torch.tensor(rows, device=ids.device))
        # the rows are the same on every rank (the LM head gathers them); only rank 0 scores them
        return logits[lasts], _prompt_scores(batch, logits, firsts) if self.comm.rank == 0 else ()


def _resolved(plan: Plan, drawn: list[int]) -> Plan:
    """The plan with its pending chunks' tokens filled in, in batch order."""
    return dataclasses.replace(plan, batch=ChunkColumns.of(plan.batch).resolved(drawn))


def _prompt_scores(batch: tuple[Chunk, ...], logits: torch.Tensor, firsts: list[int]) -> tuple[PromptLogprobs, ...]:
    """Per chunk that asks (Chunk.prompt_logprobs), the logprob of the token after each of its positions, from
    that position's logits (the chunk's rows start at firsts[i]): the chunk's own next token, and at its last
    position `next_token_id` (the prompt token after the chunk) when there is one. Computed here so the
    coordinator never sees logits."""
    out = []
    for chunk, first in zip(batch, firsts, strict=True):
        if chunk.prompt_logprobs < 0:
            continue
        targets = list(chunk.token_ids[1:]) + ([chunk.next_token_id] if chunk.next_token_id >= 0 else [])
        entries = token_logprobs(logits[first:first + len(targets)], targets, [chunk.prompt_logprobs] * len(targets),
                                 ranks=True) if targets else []
        out.append(PromptLogprobs(chunk.request_id, chunk.start, tuple(entries)))
    return tuple(out)


def _with_logprobs(sampled: tuple[Sampled, ...], logits: torch.Tensor, ks: list[int]) -> tuple[Sampled, ...]:
    """The sampled tokens whose chunks asked for logprobs (k >= 0) with them: computed here, from the logits
    the token was drawn from, so the report carries them and the coordinator never sees logits."""
    asked = [j for j, k in enumerate(ks) if k >= 0]
    if not asked:
        return sampled
    found = token_logprobs(logits[asked], [sampled[j].token_id for j in asked], [ks[j] for j in asked])
    out = list(sampled)
    for j, lp in zip(asked, found, strict=True):
        out[j] = Sampled(sampled[j].request_id, sampled[j].token_id, lp)
    return tuple(out)


def _default_kv_budget(device: torch.device, world_size: int, fraction: float | None) -> int:
    """Bytes for KV pages: a share of the free device memory left after the weights are loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (0.9 if fraction is None else fraction))
    if fraction is None:
        return DEFAULT_CPU_KV_BUDGET
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * fraction / world_size)
