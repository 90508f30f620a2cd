"""Simulated ranks for the scheduler's tests: each rank the engine's own page bookkeeping (`RankCache`, its
own pool size and its own flushes) around a fake forward, carrying out every plan as the engine does
(releases, pins, allocations, "forward", sampling, commits, flush, probes) and refusing a step as a group.

The simulated sampler draws a token from the seed, the sample index and every token the rank holds for
the request, so a rank that held the wrong tokens at the wrong positions (a bad prefix, a recompute that
resumed wrong) samples differently from the reference and the test sees it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import FINISHED, Event, Scheduler
from lockstep.kv.allocator import PagePool, PrefixNotHeld
from lockstep.kv.page_keys import key_salt
from lockstep.kv.rank_cache import RankCache, StepRefused
from lockstep.steps import Admit, Chunk, Plan, Report, Sampled

SALT = key_salt("sim-model", 4)
VOCAB = 50


def fake_sample(seed: int | None, sample_index: int, context: list[int]) -> int:
    """A token of the context and the draw alone; a greedy request's (no seed) of its context alone."""
    data = struct.pack(f"<qq{len(context)}I", -1 if seed is None else seed, sample_index, *context)
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little") % VOCAB


def reference(req: Request) -> list[int]:
    """What the request must generate: each token drawn from the exact context before it."""
    out: list[int] = []
    while len(out) < req.max_tokens:
        tok = fake_sample(req.sampling.seed, len(out), list(req.prompt_token_ids) + out)
        out.append(tok)
        if tok in req.stop_token_ids:
            break
    return out


@dataclass
class SimRank:
    """One rank: the real bookkeeping (`RankCache`) around a fake forward.

    The fake forward keeps a token where the model keeps its k/v (page * page_size + offset of the
    request's page table) and samples from what it reads back at the chunk's positions, so a page
    table that points at the wrong pages samples differently from the reference.
    """

    rank: int
    num_pages: int
    page_size: int
    caching: bool = True
    window: int = 0  # with a window, a `sliding` pool of sliding_pages pages too (a hybrid model)
    sliding_pages: int = 0
    cache: RankCache = field(init=False)
    slots: dict[str, list[int | None]] = field(init=False)

    def __post_init__(self) -> None:
        pools = {"full": PagePool("full", self.num_pages)}
        if self.window:
            pools["sliding"] = PagePool("sliding", self.sliding_pages)
        self.cache = RankCache(pools, self.page_size, SALT, max_model_len=1 << 30, prefix_caching=self.caching,
                               rank=self.rank, window=self.window)
        self.slots = {name: [None] * (p.num_pages * self.page_size) for name, p in pools.items()}

    @property
    def pool(self) -> PagePool:
        return self.cache.pool

    def prepare(self, plan: Plan, refuse: str = "", void: bool = False) -> str:
        """This rank's refusal, or "". A refusal the scheduler should never cause (an over-admission, a
        chunk at the wrong position) fails the test here; a prefix a flush took is the rank's to refuse, and
        so is a `void` plan's chunk (built ahead of a step that was then refused)."""
        try:
            self.cache.prepare(plan)
        except StepRefused as exc:
            if not isinstance(exc.__cause__, PrefixNotHeld) and not void:
                raise
            return str(exc)
        return refuse

    def finish(self, plan: Plan, refused: str) -> Report:
        sampled: list[Sampled] = []
        if refused:
            self.cache.undo_admits()
        elif plan.pool_split:  # the model's k/v tensors follow the pools, keeping the pages below the cut
            for name, total in plan.pool_split:
                slots = self.slots[name][: total * self.page_size]
                self.slots[name] = slots + [None] * (total * self.page_size - len(slots))
        else:
            sampled = [s for c in plan.batch if (s := self._forward(c)) is not None]
            for chunk in plan.batch:
                self.cache.advance(chunk)
        probes, pools = self.cache.finish(plan)
        self.cache.check()
        return Report(plan.step, self.rank, tuple(sampled), probes, pools, refused)

    def _forward(self, chunk: Chunk) -> Sampled | None:
        """Writes the chunk in every pool; samples from the full pool's slots before the window and the
        sliding pool's within it, so a wrong page in either pool draws a wrong token."""
        ps = self.page_size
        tables = {name: self.cache.table(chunk.request_id, name) for name in self.slots}
        end = chunk.start + len(chunk.token_ids)
        for name, table in tables.items():
            for pos, token in zip(range(chunk.start, end), chunk.token_ids, strict=True):
                self.slots[name][table[pos // ps] * ps + pos % ps] = token
        if not chunk.sample:
            return None
        seen = end - self.window if self.window else end

        def read(pos: int) -> int | None:
            name = "full" if pos < seen else "sliding"
            return self.slots[name][tables[name][pos // ps] * ps + pos % ps]

        context = [read(pos) for pos in range(end)]
        return Sampled(chunk.request_id, fake_sample(chunk.sampling.seed, chunk.sample_index, context))

    def warm(self, tokens: list[int]) -> None:
        """Leave the full pages of `tokens` cached (unpinned) on this rank, as an earlier request would."""
        full = tokens[: len(tokens) // self.page_size * self.page_size]
        run = Plan(step=0, admits=(Admit("warm"),), batch=(Chunk("warm", tuple(full), 0),))
        release = Plan(step=0, releases=("warm",))
        for plan in (run, release):
            assert not self.prepare(plan)
            self.finish(plan, "")

    def assert_idle(self) -> None:
        for pool in self.cache.pools.values():
            s = pool.stats()
            assert pool.owners() == [], f"rank {self.rank} still holds {pool.owners()} in {pool.name}"
            assert s.pinned == 0 and s.used == 0 and s.free + s.evictable + s.fenced == s.total, s


class Group:
    """A scheduler and its simulated ranks, stepped together; checks every plan as it goes."""

    def __init__(
        self, sched: Scheduler, pools: list[int], caching: bool = True, sliding: list[int] | None = None,
        overlap: bool = False,
    ) -> None:
        """pools[r]: rank r's full pool; with the scheduler's window, sliding[r] its sliding pool. With `overlap`
        the next plan is built ahead (Scheduler.plan_ahead) before each step's reports are applied, and pending
        tokens are filled in from rank 0's last report, as the engine's agreement collective does."""
        self.sched = sched
        self.overlap = overlap
        self.ahead: Plan | None = None  # the plan built while the last step ran
        self.ahead_plans = 0
        self.drawn: dict[str, int] = {}  # rank 0's tokens of the last step run
        self.refused_last = False
        self.flush_asked: set[int] = set()  # ranks whose flush waits for a plan built from reports
        sliding = sliding or [0] * len(pools)
        self.ranks = [SimRank(r, n, sched.page_size, caching, sched.window, s)
                      for r, (n, s) in enumerate(zip(pools, sliding, strict=True))]
        self.reports: list[Report] = []
        self.step = 0
        self.plans: list[Plan] = []
        self.events: list[Event] = []
        self.next_start: dict[str, int] = {}

    def run_step(
        self,
        flush: tuple[int, ...] = (),
        refuse: dict[int, str] | None = None,
        between: Callable[[Plan], None] | None = None,
        tamper: Callable[[list[Report]], None] | None = None,
    ) -> list[Event]:
        """One step; `between` runs while the plan is in flight, `tamper` edits the reports on their way."""
        plan, void = self.ahead, self.refused_last
        self.flush_asked |= set(flush)  # as the group's loop: a flush rides on the next plan built from reports
        flush = ()
        if plan is None:
            flush, self.flush_asked = tuple(sorted(self.flush_asked)), set()
            plan = self.sched.plan(self.step, self.reports, flush=bool(flush))
            void = False
        before = dict(self.next_start)
        self._check_plan(plan)
        if between is not None:
            between(plan)
        refuse = refuse or {}
        # As the group's step loop sends it: the flush rides only on the plans of the ranks that flush.
        plans = [replace(plan, flush_prefix_cache=True) if r.rank in flush else plan for r in self.ranks]
        plans, missing = self._fill_pending(plans)
        errors = [missing or r.prepare(p, refuse.get(r.rank, ""), void) for r, p in zip(self.ranks, plans, strict=True)]
        group_error = next((e for e in errors if e), "")
        if group_error and not void:  # nothing ran: the chunks of the running requests come again
            self.next_start = {rid: before[rid] for rid in self.next_start if rid in before}
        reports = [
            r.finish(p, (errors[r.rank] or "another rank refused") if group_error else "")
            for r, p in zip(self.ranks, plans, strict=True)
        ]
        if tamper is not None:
            tamper(reports)
        self.drawn = {s.request_id: s.token_id for s in reports[0].sampled}
        self.refused_last = bool(group_error)
        self.ahead = self.sched.plan_ahead(self.step + 1) if self.overlap and not self.flush_asked else None
        self.ahead_plans += self.ahead is not None
        events = self.sched.apply(reports)
        self.reports, self.step = reports, self.step + 1
        self.plans.append(plan)
        self.events.extend(events)
        assert self.sched.num_running <= self.sched.max_num_seqs
        return events

    def _fill_pending(self, plans: list[Plan]) -> tuple[list[Plan], str]:
        """The plans with their pending tokens filled in from rank 0's last step, and the error of one it did not
        draw (a refused step: every rank refuses, as the engine's agreement collective makes them)."""
        pending = [c.request_id for c in plans[0].batch if c.pending]
        if not pending:
            return plans, ""
        missing = [rid for rid in pending if rid not in self.drawn]
        if missing:
            return plans, f"no token drawn for pending request {missing[0]}"
        batch = tuple(replace(c, token_ids=(self.drawn[c.request_id],)) if c.pending else c for c in plans[0].batch)
        return [replace(p, batch=batch) for p in plans], ""

    def _check_plan(self, plan: Plan) -> None:
        sched = self.sched
        assert sum(len(c.token_ids) for c in plan.batch) <= sched.max_num_batched_tokens
        assert len({c.request_id for c in plan.batch}) == len(plan.batch)
        if self.overlap:  # positions and tokens are the ranks' to check (RankCache; the reference tokens)
            for c in plan.batch:
                req = sched.requests.get(c.request_id)
                if c.pending and req is not None and req.num_computed == c.start:  # its token came in meanwhile
                    assert c.sample and c.start == req.num_tokens - 1 and c.sample_index == len(req.generated), c
            return
        for rid in plan.releases:
            self.next_start.pop(rid, None)
        for admit in plan.admits:
            self.next_start[admit.request_id] = len(admit.prefix_keys) * sched.page_size
        for c in plan.batch:
            req = sched.requests[c.request_id]
            assert c.start == self.next_start[c.request_id], f"{c} is not contiguous"
            end = c.start + len(c.token_ids)
            self.next_start[c.request_id] = end
            assert c.token_ids == req.token_ids(c.start, end)
            assert c.sample == (end == req.num_tokens)
            assert c.sample_index == len(req.generated)
            assert c.sampling.seed is not None or not c.sampling.temperature > 0  # every draw has a seed
        if not sched.prefix_caching:
            assert not plan.probes and all(not a.prefix_keys for a in plan.admits)

    def run(self, limit: int = 3000) -> None:
        while self.sched.has_work() or self.ahead is not None:
            self.run_step()
            assert self.step < limit, f"no progress after {limit} steps: {self.sched.running} {self.sched.waiting}"
        for r in self.ranks:
            r.assert_idle()


def make_sched(ranks: int = 1, budget: int = 16, seqs: int = 4, caching: bool = True, **kw) -> Scheduler:
    return Scheduler(4, SALT, budget, seqs, ranks, prefix_caching=caching, **kw)


def finished(events: list[Event]) -> dict[str, Event]:
    return {e.request_id: e for e in events if e.kind == FINISHED}



def computed_tokens(plans: list[Plan]) -> dict[str, int]:
    """Positions each request computed over `plans` (prefill chunks and decodes), by request id."""
    out: dict[str, int] = {}
    for plan in plans:
        for c in plan.batch:
            out[c.request_id] = out.get(c.request_id, 0) + len(c.token_ids)
    return out
