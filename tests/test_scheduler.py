"""The scheduler driven against simulated ranks: one real PagePool per rank, each rank its own size and
its own flushes, carrying out every plan the way the engine does (releases, flush, pins, allocations,
"forward", sampling, commits, probes) and refusing a step as a group.

The simulated sampler draws a token from the seed, the sample index and every token the rank holds for
the request, so a rank that held the wrong tokens at the wrong positions (a bad prefix, a recompute that
resumed wrong) samples differently from the reference and the test sees it.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.coordinator.admission import pages_for
from lockstep.coordinator.request import Request, RequestStatus, default_seed
from lockstep.coordinator.scheduler import FINISHED, PREEMPTED, TOKEN, Event, Scheduler
from lockstep.kv.allocator import PagePool, PrefixNotHeld
from lockstep.kv.page_keys import key_salt, next_key, page_keys
from lockstep.steps import Plan, ProbeAnswer, Report, Sampled, SamplingParams

SALT = key_salt("sim-model", 4)
VOCAB = 50


def fake_sample(seed: int, sample_index: int, context: list[int]) -> int:
    data = struct.pack(f"<qq{len(context)}I", seed, sample_index, *context)
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
class _Seq:
    tokens: list[int]
    committed: int
    parent: bytes | None


@dataclass
class SimRank:
    rank: int
    num_pages: int
    page_size: int
    caching: bool = True
    pool: PagePool = field(init=False)
    seqs: dict[str, _Seq] = field(default_factory=dict)
    contents: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    allocated: int = 0

    def __post_init__(self) -> None:
        self.pool = PagePool("default", self.num_pages)

    def prepare(self, plan: Plan, flush: bool, refuse: str = "") -> str:
        for rid in plan.releases:
            self.pool.release(rid)
            self.seqs.pop(rid, None)
        if flush:
            self.pool.flush()
        try:
            for admit in plan.admits:
                assert admit.request_id not in self.seqs, f"{admit.request_id} admitted twice"
                self.pool.pin(admit.request_id, admit.prefix_keys)
                tokens = [t for k in admit.prefix_keys for t in self.contents[k]]
                parent = admit.prefix_keys[-1] if admit.prefix_keys else None
                self.seqs[admit.request_id] = _Seq(tokens, len(admit.prefix_keys), parent)
        except PrefixNotHeld as exc:
            return str(exc)
        for chunk in plan.batch:
            seq = self.seqs[chunk.request_id]
            assert chunk.start == len(seq.tokens), f"rank {self.rank}: {chunk} but holds {len(seq.tokens)}"
            need = pages_for(chunk.start + len(chunk.token_ids), self.page_size)
            need -= len(self.pool.table(chunk.request_id))
            if need > 0:
                self.pool.allocate(chunk.request_id, need)  # OutOfPages here: the scheduler over-admitted
                self.allocated += need
        return refuse

    def finish(self, plan: Plan, refused: str) -> Report:
        report = Report(step=plan.step, rank=self.rank)
        if refused:
            for admit in plan.admits:
                self.pool.release(admit.request_id)
                self.seqs.pop(admit.request_id, None)
            report.error = refused
        else:
            for chunk in plan.batch:
                seq = self.seqs[chunk.request_id]
                seq.tokens.extend(chunk.token_ids)
                if chunk.sample:
                    tok = fake_sample(chunk.sampling.seed, chunk.sample_index, seq.tokens)
                    report.sampled.append(Sampled(chunk.request_id, tok))
                if self.caching:
                    self._commit(chunk.request_id, seq)
        for probe in plan.probes:
            matched, pinned = self.pool.probe(probe.keys) if self.caching else (0, 0)
            report.probes.append(ProbeAnswer(probe.request_id, matched, pinned))
        report.pools = [self.pool.stats()]
        self.pool.check()
        return report

    def _commit(self, rid: str, seq: _Seq) -> None:
        table = self.pool.table(rid)
        ps = self.page_size
        for i in range(seq.committed, len(seq.tokens) // ps):
            page = tuple(seq.tokens[i * ps : (i + 1) * ps])
            key = next_key(seq.parent, page, SALT)
            self.pool.commit(rid, table[i], key)
            self.contents[key] = page
            seq.parent = key
        seq.committed = max(seq.committed, len(seq.tokens) // ps)

    def warm(self, tokens: list[int]) -> None:
        """Leave the full pages of `tokens` cached (unpinned) on this rank, as an earlier request would."""
        keys = page_keys(tokens, self.page_size, SALT)
        self.pool.allocate("warm", len(keys))
        for i, (page, key) in enumerate(zip(self.pool.table("warm"), keys, strict=True)):
            self.pool.commit("warm", page, key)
            self.contents[key] = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
        self.pool.release("warm")

    def assert_idle(self) -> None:
        s = self.pool.stats()
        assert self.pool.owners() == [], f"rank {self.rank} still holds {self.pool.owners()}"
        assert s.pinned == 0 and s.used == 0 and s.free + s.evictable == s.total, s


class Group:
    """A scheduler and its simulated ranks, stepped together; checks every plan as it goes."""

    def __init__(self, sched: Scheduler, pools: list[int], caching: bool = True) -> None:
        self.sched = sched
        self.ranks = [SimRank(r, n, sched.page_size, caching) for r, n in enumerate(pools)]
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
        plan = self.sched.plan(self.step, self.reports, flush=bool(flush))
        before = dict(self.next_start)
        self._check_plan(plan)
        if between is not None:
            between(plan)
        refuse = refuse or {}
        errors = [r.prepare(plan, r.rank in flush, refuse.get(r.rank, "")) for r in self.ranks]
        group_error = next((e for e in errors if e), "")
        if group_error:  # nothing ran: the chunks of the running requests come again
            self.next_start = {rid: before[rid] for rid in self.next_start if rid in before}
        reports = [
            r.finish(plan, (errors[r.rank] or "another rank refused") if group_error else "")
            for r in self.ranks
        ]
        if tamper is not None:
            tamper(reports)
        events = self.sched.apply(reports)
        self.reports, self.step = reports, self.step + 1
        self.plans.append(plan)
        self.events.extend(events)
        assert self.sched.num_running <= self.sched.max_num_seqs
        return events

    def _check_plan(self, plan: Plan) -> None:
        sched = self.sched
        assert sum(len(c.token_ids) for c in plan.batch) <= sched.max_num_batched_tokens
        assert len({c.request_id for c in plan.batch}) == len(plan.batch)
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
            assert c.sampling.seed is not None
        if not sched.prefix_caching:
            assert not plan.probes and all(not a.prefix_keys for a in plan.admits)

    def run(self, limit: int = 3000) -> None:
        while self.sched.has_work():
            self.run_step()
            assert self.step < limit, f"no progress after {limit} steps: {self.sched.running} {self.sched.waiting}"
        for r in self.ranks:
            r.assert_idle()


def make_sched(ranks: int = 1, budget: int = 16, seqs: int = 4, caching: bool = True, **kw) -> Scheduler:
    return Scheduler(4, SALT, budget, seqs, ranks, prefix_caching=caching, **kw)


def finished(events: list[Event]) -> dict[str, Event]:
    return {e.request_id: e for e in events if e.kind == FINISHED}


def test_chunked_prefill_then_decode_with_positions_and_sample_index():
    sched = make_sched(budget=8, caching=False)
    g = Group(sched, [64], caching=False)
    req = Request("a", list(range(1, 21)), max_tokens=3)
    sched.add(req)
    while sched.has_work():
        g.run_step()
    batches = [[(c.start, len(c.token_ids), c.sample, c.sample_index) for c in p.batch] for p in g.plans]
    assert [b for b in batches if b] == [
        [(0, 8, False, 0)], [(8, 8, False, 0)], [(16, 4, True, 0)], [(20, 1, True, 1)], [(21, 1, True, 2)]
    ]
    assert req.generated == reference(req) and req.finish_reason == "length"
    assert req.sampling.seed == default_seed("a")
    assert [e.kind for e in g.events] == [TOKEN, TOKEN, TOKEN, FINISHED]
    assert "a" in g.plans[-1].releases
    g.ranks[0].assert_idle()


def test_stop_token_finishes_and_releases():
    probe = Request("s", [3, 4, 5], max_tokens=50)
    ref = reference(probe)
    stop = ref[2]
    req = Request("s", [3, 4, 5], max_tokens=50, stop_token_ids=[stop])
    sched = make_sched()
    g = Group(sched, [32])
    sched.add(req)
    g.run()
    assert req.generated[-1] == stop and stop not in req.generated[:-1]
    assert req.finish_reason == "stop" and req.generated == reference(req)


def test_probe_then_admit_with_the_prefix_every_rank_holds():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 23))  # 5 full pages of 4, and 2 tokens
    g.ranks[0].warm(prompt[:20])
    g.ranks[1].warm(prompt[:12])
    req = Request("p", prompt, max_tokens=2)
    sched.add(req)
    g.run_step()
    g.run_step()
    first, plan = g.plans
    assert [p.request_id for p in first.probes] == ["p"] and not first.admits  # no pool states yet
    assert [a.request_id for a in plan.admits] == ["p"] and not plan.probes  # admitted from report 0
    assert plan.admits[0].prefix_keys == tuple(page_keys(prompt, 4, SALT)[:3])
    assert plan.batch[0].start == 12 and plan.batch[0].token_ids == tuple(prompt[12:])
    g.run()
    assert req.cached_tokens == 12 and req.generated == reference(req)
    assert sched.stats.prefix_agreed_pages == 3 and sched.stats.prefix_offered_pages == [5, 3]


def test_exact_page_prompt_reuses_all_but_the_last_page():
    sched = make_sched(ranks=1, budget=64)
    g = Group(sched, [40])
    prompt = list(range(1, 17))  # exactly 4 pages
    g.ranks[0].warm(prompt)
    req = Request("x", prompt, max_tokens=1)
    sched.add(req)
    g.run()
    admit_plan = next(p for p in g.plans if p.admits)
    assert len(admit_plan.admits[0].prefix_keys) == 3
    assert admit_plan.batch[0].start == 12 and admit_plan.batch[0].sample
    assert req.generated == reference(req)


def test_prefix_caching_off_sends_no_probe_and_admits_at_once():
    sched = make_sched(ranks=2, caching=False)
    g = Group(sched, [32, 32], caching=False)
    sched.add(Request("a", list(range(1, 12)), max_tokens=2))
    g.run_step()  # no reports yet: nothing can be admitted
    assert not g.plans[0].admits and not g.plans[0].probes
    g.run_step()
    assert [a.request_id for a in g.plans[1].admits] == ["a"] and not g.plans[1].probes
    g.run()


def test_short_prompt_needs_no_probe():
    sched = make_sched(ranks=2)
    g = Group(sched, [32, 32])
    g.run_step()
    sched.add(Request("a", [1, 2, 3, 4], max_tokens=1))  # one page: the cap leaves nothing to reuse
    g.run_step()
    assert [a.request_id for a in g.plans[1].admits] == ["a"] and not g.plans[1].probes


def test_shared_prefix_second_request_reuses_what_the_first_committed():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 24])
    prefix = list(range(1, 17))
    a = Request("a", prefix + [30, 31], max_tokens=2)
    sched.add(a)
    g.run()
    b = Request("b", prefix + [40, 41, 42], max_tokens=2)
    sched.add(b)
    g.run()
    assert b.cached_tokens == 16 and b.generated == reference(b)


def test_flushed_rank_lowers_the_agreed_prefix():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 18))
    g.ranks[0].warm(prompt)
    g.ranks[1].warm(prompt)
    g.run_step(flush=(1,))
    req = Request("f", prompt, max_tokens=1)
    sched.add(req)
    g.run()
    assert req.cached_tokens == 0 and req.generated == reference(req)


def test_flush_in_the_admitting_step_admits_without_a_prefix():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 18))
    for r in g.ranks:
        r.warm(prompt)
    g.run_step()
    sched.add(Request("f", prompt, max_tokens=1))
    g.run_step()  # probed
    g.run_step(flush=(0,))  # would be admitted with 4 pages; rank 0 drops them before pinning
    admits = [a for p in g.plans for a in p.admits]
    assert admits and admits[0].prefix_keys == ()
    g.run()
    assert not any(e.error for e in g.events)


def test_preemption_under_pressure_recomputes_and_resumes():
    sched = make_sched(ranks=2, budget=32, seqs=4, caching=False)
    g = Group(sched, [12, 9], caching=False)
    reqs = [Request(f"r{i}", [i + 1] * 6, max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    g.run()
    assert sched.stats.preemptions > 0
    preempted = {e.request_id for e in g.events if e.kind == PREEMPTED}
    assert preempted and "r0" not in preempted  # the newest give way, never the oldest first
    for r in reqs:
        assert r.finish_reason == "length" and r.generated == reference(r), r
    assert any(r.num_preemptions for r in reqs)


def test_preempted_request_recompute_starts_at_prompt_plus_generated():
    sched = make_sched(ranks=1, budget=32, seqs=4, caching=False)
    g = Group(sched, [8], caching=False)
    a = Request("a", [1] * 8, max_tokens=16)
    b = Request("b", [2] * 8, max_tokens=16)
    sched.add(a)
    sched.add(b)
    while not any(e.kind == PREEMPTED for e in g.events):
        g.run_step()
    victim = next(r for r in (a, b) if r.num_preemptions)
    assert victim is b and victim.status is RequestStatus.WAITING and victim.num_computed == 0
    kept = list(victim.generated)
    assert kept
    while not any(a.request_id == "b" for a in g.plans[-1].admits):
        g.run_step()
    chunks = [c for c in g.plans[-1].batch if c.request_id == "b"]
    recompute = tuple([2] * 8 + kept)
    assert chunks[0].start == 0 and chunks[0].token_ids == recompute[: len(chunks[0].token_ids)]
    g.run()
    assert b.generated[: len(kept)] == kept and b.generated == reference(b)


def test_request_too_big_for_the_smallest_rank_fails_with_a_reason():
    sched = make_sched(ranks=2)
    g = Group(sched, [40, 6])
    big = Request("big", [1] * 20, max_tokens=8)  # 27 positions: 7 pages > 6
    ok = Request("ok", [1] * 20, max_tokens=4)  # 23 positions: 6 pages
    sched.add(big)
    sched.add(ok)
    g.run()
    assert big.finish_reason == "error" and "smallest rank pool holds 6" in big.error
    assert ok.finish_reason == "length" and ok.generated == reference(ok)


def test_abort_waiting_running_and_in_flight_leaks_nothing():
    sched = make_sched(ranks=2, budget=8, seqs=2, caching=False)
    g = Group(sched, [30, 20], caching=False)
    reqs = [Request(f"a{i}", list(range(1, 15)), max_tokens=30) for i in range(4)]
    for r in reqs:
        sched.add(r)
    g.run_step()
    g.run_step()
    g.run_step()
    assert reqs[0].status is RequestStatus.RUNNING and reqs[3].status is RequestStatus.WAITING
    assert sched.abort("a3") == [Event("a3", FINISHED, finish_reason="abort")]
    assert sched.abort("a0")[0].finish_reason == "abort"
    assert sched.abort("a0") == [] and sched.abort("nope") == []
    g.run_step()
    assert "a0" in g.plans[-1].releases and "a3" not in g.plans[-1].releases
    # abort while the plan runs: its report carries a token nobody wants, its pages go next plan
    in_flight: list[str] = []

    def abort_first(plan: Plan) -> None:
        in_flight.append(plan.batch[0].request_id)
        sched.abort(in_flight[0])

    events = g.run_step(between=abort_first)
    assert in_flight and not [e for e in events if e.request_id == in_flight[0]]
    g.run_step()
    assert in_flight[0] in g.plans[-1].releases
    g.run()
    assert all(r.finish_reason == "abort" for r in reqs if r.request_id in {"a0", "a3", in_flight[0]})
    assert all(r.generated == reference(r) for r in reqs if r.finish_reason == "length")


def test_step_refused_by_every_rank_fails_admits_and_replans_the_rest():
    sched = make_sched(ranks=2, budget=16, seqs=4, caching=False)
    g = Group(sched, [30, 30], caching=False)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    g.run_step()
    g.run_step()
    g.run_step()
    c = Request("c", [6], max_tokens=1)
    sched.add(c)
    g.run_step()
    assert c.finish_reason == "length"
    b = Request("b", [7, 8, 9], max_tokens=3)
    sched.add(b)
    before = a.num_computed
    events = g.run_step(refuse={1: "rank 1: injected"})
    plan = g.plans[-1]
    assert [x.request_id for x in plan.admits] == ["b"] and plan.releases == ("c",)
    assert finished(events)["b"].finish_reason == "error" and "injected" in finished(events)["b"].error
    assert a.num_computed == before and a.status is RequestStatus.RUNNING
    g.next_start["a"] = before
    g.run_step()
    assert set(g.plans[-1].releases) == {"b", "c"}  # a refusing rank may not have carried them out
    assert [c.start for c in g.plans[-1].batch if c.request_id == "a"] == [before]
    g.run()
    assert a.generated == reference(a) and sched.stats.failed_steps == 1


def test_step_refused_by_only_some_ranks_preempts_the_batch():
    sched = make_sched(ranks=2, budget=16, caching=False)
    g = Group(sched, [30, 30], caching=False)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    g.run_step()
    g.run_step()

    def rank1_failed(reports: list[Report]) -> None:
        reports[1].error = "rank 1: lost its device"

    events = g.run_step(tamper=rank1_failed)
    assert [e.kind for e in events] == [PREEMPTED] and a.status is RequestStatus.WAITING
    assert a.num_preemptions == 1 and sched.stats.failed_steps == 1
    g.run_step()
    assert "a" in g.plans[-1].releases
    g.run()
    assert a.generated == reference(a)


def test_missing_sample_fails_only_that_request():
    sched = make_sched(ranks=1, caching=False)
    g = Group(sched, [30], caching=False)
    sched.add(Request("a", [1, 2], max_tokens=3))
    g.run_step()
    events = g.run_step(tamper=lambda reports: reports[0].sampled.clear())
    assert finished(events)["a"].finish_reason == "error" and "no rank sampled" in finished(events)["a"].error
    g.run()


def test_duplicate_report_delivery_is_ignored_and_never_re_arms_a_probe():
    sched = make_sched(ranks=2, budget=64)
    g = Group(sched, [40, 40])
    prompt = list(range(1, 14))
    for r in g.ranks:
        r.warm(prompt)
    g.run_step()
    sched.add(Request("d", prompt, max_tokens=2))
    g.run_step()  # probe
    g.run_step()  # admitted with the answers
    assert g.plans[-1].admits and not g.plans[-1].probes
    assert sched.apply(g.reports) == []  # the same reports again
    g.run_step()
    assert not g.plans[-1].probes and not g.plans[-1].admits
    g.run()


def test_bad_protocol_use_gets_specific_errors():
    sched = make_sched(ranks=2)
    sched.add(Request("a", [1, 2, 3], max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Request("a", [1], max_tokens=1))
    plan = sched.plan(0, [])
    with pytest.raises(ValueError, match="not applied"):
        sched.plan(1, [])
    one = Report(step=0, rank=0)
    with pytest.raises(ValueError, match=r"ranks \[1\] are missing"):
        sched.apply([one])
    with pytest.raises(ValueError, match="two reports from rank 0"):
        sched.apply([one, Report(step=0, rank=0)])
    with pytest.raises(ValueError, match="do not answer a plan in flight"):
        sched.apply([Report(step=5, rank=0), Report(step=5, rank=1)])
    sched.apply([Report(step=0, rank=r) for r in range(2)])
    with pytest.raises(ValueError, match="must come after"):
        sched.plan(plan.step, [])
    with pytest.raises(ValueError, match="no pool states"):
        sched.plan(1, [Report(step=0, rank=r) for r in range(2)])
    with pytest.raises(ValueError, match="exceed the model's 8 positions"):
        make_sched(max_model_len=8).add(Request("long", [1] * 5, max_tokens=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(4, SALT, 16, 0, 1)


def test_requeue_all_keeps_every_request_for_a_fresh_group():
    """The group goes down with a plan in flight: every request waits, with its tokens, and a fresh
    group (new ranks, no reports yet) finishes all of them with the tokens of an undisturbed run."""
    sched = make_sched(ranks=2, caching=False)
    g = Group(sched, [30, 30], caching=False)
    reqs = [Request(f"q{i}", [1, 2, 3], max_tokens=20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    for _ in range(4):
        g.run_step()
    sched.plan(g.step, g.reports)  # in flight when the group goes down
    events = sched.requeue_all()
    assert {e.request_id for e in events} == {r.request_id for r in reqs if r.generated}
    assert sched.num_running == 0 and sched.num_waiting == 3 and all(r.num_computed == 0 for r in reqs)
    assert sched.stats.preemptions == 0  # not counted: nothing was short of pages
    fresh = Group(sched, [30, 30], caching=False)
    fresh.step = g.step + 1
    sched.add(Request("after", [5, 6], max_tokens=2))
    fresh.run()
    assert all(r.generated == reference(r) for r in reqs)


# ----- the randomized multi-rank run

PREFIXES = [[(7 * k + i) % VOCAB for i in range(16)] for k in range(4)]


@dataclass
class Workload:
    pools: list[int]
    budget: int
    seqs: int
    caching: bool
    arrivals: list[tuple[int, int, int, list[int], int, bool]]  # step, prefix, its length, own, max_tokens, stop
    flushes: dict[int, int] = field(default_factory=dict)  # step -> rank
    aborts: dict[int, int] = field(default_factory=dict)  # step -> request index
    refusals: set[int] = field(default_factory=set)  # steps rank 0 refuses


def drive(w: Workload) -> Group:
    """Run a workload to the end and check everything a client and an operator would check."""
    sched = make_sched(ranks=len(w.pools), budget=w.budget, seqs=w.seqs, caching=w.caching)
    g = Group(sched, w.pools, caching=w.caching)
    reqs = [
        Request(f"r{i}", PREFIXES[pre][:plen] + own, SamplingParams(), max_tokens, [3] if stop else ())
        for i, (_, pre, plen, own, max_tokens, stop) in enumerate(w.arrivals)
    ]
    order = sorted(range(len(reqs)), key=lambda i: w.arrivals[i][0])
    aborted: set[str] = set()
    nxt = 0
    while nxt < len(order) or sched.has_work():
        while nxt < len(order) and w.arrivals[order[nxt]][0] <= g.step:
            sched.add(reqs[order[nxt]])
            nxt += 1
        victim = w.aborts.get(g.step)
        if victim is not None and victim < len(reqs) and sched.abort(reqs[victim].request_id):
            aborted.add(reqs[victim].request_id)
        flush = (w.flushes[g.step],) if g.step in w.flushes else ()
        g.run_step(flush=flush, refuse={0: "injected"} if g.step in w.refusals else None)
        assert g.step < 5000, "no progress"
    for r in g.ranks:
        r.assert_idle()
    refused_admits = 0
    for req in reqs:
        assert req.finished, req
        tokens = [e.token_id for e in g.events if e.kind == TOKEN and e.request_id == req.request_id]
        assert tokens == req.generated
        if req.request_id in aborted:
            assert req.finish_reason == "abort"
        elif pages_for(req.max_positions, 4) > min(w.pools):
            assert req.finish_reason == "error" and "smallest rank pool" in req.error
        elif req.finish_reason == "error":
            assert "injected" in req.error, req.error
            refused_admits += 1
        else:
            ref = reference(req)
            assert req.generated == ref, (req, ref)
            assert req.finish_reason == ("stop" if ref[-1] in req.stop_token_ids else "length")
    assert refused_admits <= len(w.refusals) * w.seqs
    return g


@st.composite
def workloads(draw) -> Workload:
    ranks = draw(st.integers(1, 3))
    arrival = st.tuples(
        st.integers(0, 120),
        st.integers(0, 3),
        st.integers(0, 14),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
        st.integers(1, 30),
        st.booleans(),
    )
    return Workload(
        pools=draw(st.lists(st.integers(8, 30), min_size=ranks, max_size=ranks)),
        budget=draw(st.integers(3, 24)),
        seqs=draw(st.integers(1, 8)),
        caching=draw(st.booleans()),
        arrivals=draw(st.lists(arrival, min_size=2, max_size=40)),
        flushes=draw(st.dictionaries(st.integers(0, 150), st.integers(0, ranks - 1), max_size=4)),
        aborts=draw(st.dictionaries(st.integers(0, 150), st.integers(0, 39), max_size=3)),
        refusals=draw(st.sets(st.integers(0, 150), max_size=2)),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_multi_rank_runs_never_overdraw_and_finish_every_request(w: Workload):
    drive(w)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_run_of_divergent_ranks_under_pressure(seed: int):
    rng = random.Random(seed)
    arrivals = [
        (rng.randrange(600), rng.randrange(4), rng.randrange(17),
         [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))], rng.randint(1, 24), rng.random() < 0.3)
        for _ in range(160)
    ]
    w = Workload(
        pools=[14, 10, 18], budget=10, seqs=6, caching=True, arrivals=arrivals,
        flushes={s: rng.randrange(3) for s in range(25, 700, 45)},
        aborts={rng.randrange(700): rng.randrange(160) for _ in range(6)},
        refusals={rng.randrange(700) for _ in range(3)},
    )
    g = drive(w)
    assert g.step > 600
    assert g.sched.stats.preemptions > 0 and g.sched.stats.prefix_hit_tokens > 0
    assert any(len(a.prefix_keys) for p in g.plans for a in p.admits)


def test_pressure_workload_preempts_and_still_finishes_everything():
    sched = make_sched(ranks=3, budget=12, seqs=6, caching=True)
    g = Group(sched, [16, 12, 20])
    reqs = [Request(f"p{i}", PREFIXES[i % 2][: 6 + i] + [i], max_tokens=14) for i in range(8)]
    for r in reqs:
        sched.add(r)
    g.run()
    assert sched.stats.preemptions >= 2
    for r in reqs:
        assert r.generated == reference(r) and r.finish_reason == "length"
    assert max(r.num_preemptions for r in reqs) >= 1
    assert sched.stats.prefix_hit_tokens > 0


def test_pages_a_release_frees_count_only_from_the_next_report():
    sched = make_sched(ranks=1, budget=64, caching=False)
    g = Group(sched, [5], caching=False)
    a = Request("a", [1] * 8, max_tokens=1)  # holds 2 pages
    b = Request("b", [2] * 16, max_tokens=1)  # needs 4 pages at once
    sched.add(a)
    sched.add(b)
    g.run_step()
    g.run_step()
    assert a.finish_reason == "length" and [x.request_id for x in g.plans[1].admits] == ["a"]
    g.run_step()
    assert g.plans[2].releases == ("a",) and not g.plans[2].admits  # report 1 still shows a's pages
    g.run_step()
    assert [x.request_id for x in g.plans[3].admits] == ["b"]
    assert sched.stats.deferred["pages"] == 2
    g.run()


def test_requeue_all_keeps_requests_across_a_dead_rank_and_replays_them():
    sched = make_sched(ranks=2, budget=8, caching=True)
    g = Group(sched, [30, 30])
    reqs = [Request(f"k{i}", list(range(1, 11)), max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add(r)
    for _ in range(6):
        g.run_step()
    sched.plan(g.step, g.reports)  # in flight when rank 1 dies
    kept = {r.request_id: list(r.generated) for r in reqs}
    running = [r.request_id for r in sched.running]
    assert len(running) >= 2 and any(kept.values())
    events = sched.requeue_all()
    assert sorted(e.request_id for e in events) == sorted(running)
    assert all(e.kind == PREEMPTED for e in events) and sched.stats.preemptions == 0
    assert [r.request_id for r in sched.waiting] == ["k0", "k1", "k2"]  # arrival order kept
    fresh = Group(sched, [30, 30])  # the group recreated: empty caches
    fresh.step = g.step + 1
    fresh.run()
    for r in reqs:
        assert r.generated[: len(kept[r.request_id])] == kept[r.request_id]
        assert r.generated == reference(r) and r.finish_reason == "length"


def test_a_request_adopted_from_a_dead_group_resumes_where_it_was():
    """Group A goes down mid-generation; group B adopts the request, recomputes prompt + generated and
    produces exactly the tokens an undisturbed run would have, keeping what the client already has."""
    a_sched = make_sched(budget=32, caching=False)
    a = Group(a_sched, [32], caching=False)
    req = Request("r", list(range(1, 11)), max_tokens=12)
    a_sched.add(req)
    while len(req.generated) < 5:
        a.run_step()
    kept = list(req.generated)
    a_sched.requeue_all()
    b_sched = make_sched(budget=32)
    b = Group(b_sched, [32])
    b_sched.adopt(req)
    with pytest.raises(ValueError, match="already in use"):
        b_sched.adopt(req)
    b.run_step()
    b.run_step()
    first = next(c for p in b.plans for c in p.batch if c.request_id == "r")
    assert first.start == 0 and first.token_ids == tuple(range(1, 11)) + tuple(kept)
    assert first.sample and first.sample_index == len(kept)
    b.run()
    assert req.generated[: len(kept)] == kept and req.generated == reference(req)


def test_a_refusal_that_repeats_preempts_instead_of_replanning_forever():
    sched = make_sched(ranks=2, budget=16, caching=False)
    g = Group(sched, [30, 30], caching=False)
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    g.run_step()
    g.run_step()
    assert a.status is RequestStatus.RUNNING
    g.run_step(refuse={0: "rank 0: keeps refusing", 1: "rank 1: keeps refusing"})
    assert a.status is RequestStatus.RUNNING  # once: planned again as it was
    events = g.run_step(refuse={0: "rank 0: keeps refusing", 1: "rank 1: keeps refusing"})
    assert [e.kind for e in events] == [PREEMPTED] and a.status is RequestStatus.WAITING
    g.run()
    assert a.generated == reference(a)
