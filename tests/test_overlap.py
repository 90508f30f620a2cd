"""Overlap scheduling (coordinator/lookahead.py, Scheduler.plan_ahead): plan k + 1 is built while step k runs,
and every output stays what the one-plan-at-a-time scheduler gives, with nothing leaked."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import FINISHED, TOKEN
from lockstep.steps import PENDING_TOKEN, SamplingParams
from sim_ranks import Group, make_sched, reference
from test_scheduler_random import Workload, drive, seeded_pressure, workloads


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_runs_with_overlap_finish_every_request_with_the_reference_tokens(w: Workload):
    w.overlap = True
    drive(w)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_overlapped_run_under_pressure_plans_ahead_and_matches_the_reference(seed: int):
    """Tight, divergent pools with flushes: plans built ahead probe the waiting requests and admit those with no
    prefix to agree on, and never pin one (the answers they would pin from may have gone stale since)."""
    g = drive(seeded_pressure(seed, [14, 10, 18], overlap=True))
    ahead = [p for p in g.plans if any(c.pending for c in p.batch)]
    assert ahead  # few: under this pressure the head of the queue is nearly always waiting for its answers
    assert all(not a.prefix_keys for p in ahead for a in p.admits)
    assert any(a.prefix_keys for p in g.plans for a in p.admits)  # from the reports that answered their probes
    assert g.sched.stats.preemptions > 0 and g.sched.stats.failed_steps <= 3  # only the injected refusals


SEED = 5


def _decode_group(n: int, max_tokens: int, stop: tuple[int, ...] = ()) -> tuple[Group, list[Request]]:
    sched = make_sched(ranks=2, budget=32, seqs=n)
    g = Group(sched, [64, 64], overlap=True)
    reqs = [Request(f"r{i}", [1 + i, 2, 3, 4, 5], SamplingParams(seed=SEED + i), max_tokens, stop) for i in range(n)]
    for r in reqs:
        sched.add(r)
    return g, reqs


def test_steady_decode_is_planned_ahead_with_pending_tokens():
    g, reqs = _decode_group(3, 12)
    g.run()
    ahead = [p for p in g.plans if any(c.pending for c in p.batch)]
    assert len(ahead) >= 9  # every decode after the first of each request
    for p in ahead:
        assert not p.admits and not p.probes
        assert all(c.token_ids == (PENDING_TOKEN,) and c.sample for c in p.batch if c.pending)
    for r in reqs:
        assert r.generated == reference(r) and r.finish_reason == "length"
    # max_tokens is known: no decode is planned past a request's last token
    assert sum(len(c.token_ids) for p in g.plans for c in p.batch if c.request_id == "r0") == 5 + 12 - 1


def test_a_stop_token_costs_at_most_one_wasted_decode_that_is_never_sent():
    probe = Request("r0", [1, 2, 3, 4, 5], SamplingParams(seed=SEED), 12)
    stop_at = reference(probe)[3]  # the fourth token stops the request (the probe draws as r0 will: one seed)
    g, (req,) = _decode_group(1, 12, (stop_at,))
    g.run()
    want = reference(req)
    assert req.generated == want and req.finish_reason == "stop"
    tokens = [e.token_id for e in g.events if e.kind == TOKEN]
    assert tokens == want
    decodes = sum(1 for p in g.plans for c in p.batch if c.request_id == req.request_id)
    assert decodes <= len(want) + 1  # the prefill sampled the first token; one decode at most was wasted
    for r in g.ranks:
        r.assert_idle()


def test_cancelling_with_a_plan_in_flight_leaks_nothing():
    g, reqs = _decode_group(2, 30)
    for _ in range(4):
        g.run_step()
    assert g.ahead is not None and any(c.request_id == "r0" for c in g.ahead.batch)
    ended = g.sched.abort("r0")  # the client goes away while a plan with its decode is in flight
    assert [e.kind for e in ended] == [FINISHED]
    seen = len(g.events)
    g.run()  # that plan runs; its token for r0 is dropped, and the next plan releases r0 on every rank
    assert not [e for e in g.events[seen:] if e.request_id == "r0"]
    assert reqs[0].finish_reason == "abort"
    assert reqs[1].generated == reference(reqs[1])


def test_a_refused_step_voids_the_plan_built_ahead_of_it_and_nothing_is_lost():
    g, reqs = _decode_group(2, 10)
    for _ in range(3):
        g.run_step()
    assert g.ahead is not None
    g.run_step(refuse={1: "injected"})  # the step in flight is refused; the plan built ahead of it is void
    assert g.refused_last and g.ahead is not None
    g.run_step()  # the void plan: every rank refuses it, and it neither counts nor preempts
    assert g.sched.stats.preemptions == 0 and g.sched.stats.failed_steps == 1
    g.run()
    for r in reqs:
        assert r.generated == reference(r) and r.finish_reason == "length"


def test_an_arrival_costs_the_overlap_one_step_and_its_time_to_first_token_nothing():
    """A request arriving mid-run used to stop the overlap for two steps (its probe, then its admission, each
    waiting for the last reports). Now a plan built ahead probes it, and the plan built from the reports that
    answer the probe admits it, as soon as before; the plans after it are built ahead again."""
    g, reqs = _decode_group(1, 20)
    g.sched.max_num_seqs = 2
    for _ in range(3):
        g.run_step()
    assert g.ahead is not None
    late = Request("late", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(), 4)  # r0's first page, cached by now
    g.sched.add(late)
    arrived = len(g.plans)
    g.run()
    after = g.plans[arrived:]
    probed = next(p for p in after if any(q.request_id == "late" for q in p.probes))
    admitted = next(p for p in after if any(a.request_id == "late" for a in p.admits))
    assert any(c.pending for c in probed.batch)  # built ahead
    assert admitted.step == probed.step + 1 and not any(c.pending for c in admitted.batch)  # from its reports
    assert [len(a.prefix_keys) for a in admitted.admits] == [1] and late.cached_tokens == 4
    from_reports = [p.step for p in after if p.batch and not any(c.pending for c in p.batch)]
    assert from_reports == [admitted.step]  # the only plan after the arrival not built ahead
    assert late.generated == reference(late) and reqs[0].generated == reference(reqs[0])


def test_without_a_prefix_to_agree_on_an_arrival_is_admitted_ahead_and_the_overlap_never_stops():
    g, reqs = _decode_group(1, 20)
    g.sched.max_num_seqs = 2
    for _ in range(3):
        g.run_step()
    late = Request("late", [9, 9, 9], SamplingParams(), 4)  # shorter than a page and a token: nothing to probe
    g.sched.add(late)
    arrived = len(g.plans)
    g.run()
    after = [p for p in g.plans[arrived:] if p.batch]
    admitted = next(p for p in after if any(a.request_id == "late" for a in p.admits))
    assert all(any(c.pending for c in p.batch) for p in after)  # every plan built ahead, the admitting one too
    assert admitted is after[1]  # the first plan built after it came (after[0] was in flight already)
    assert late.generated == reference(late) and reqs[0].generated == reference(reqs[0])


def test_a_flush_waits_for_a_plan_built_from_reports():
    g, reqs = _decode_group(1, 20)
    g.sched.max_num_seqs = 3
    for _ in range(3):
        g.run_step()
    late = [Request(f"late{i}", [1, 2, 3, 4, 5, 6, 7, 8, 9 + i], SamplingParams(), 4) for i in range(3)]
    for r in late:
        g.sched.add(r)
    g.run_step()
    g.run_step(flush=(1,))  # asked while a plan built ahead is in flight: it rides on the next plan from reports
    assert g.ahead is None
    g.run()
    assert not any(c.pending for c in g.plans[5].batch)  # the flushing plan
    for r in [*late, *reqs]:
        assert r.generated == reference(r)
    assert g.sched.stats.failed_steps == 0


def test_a_request_admitted_by_a_void_plan_waits_again_instead_of_failing():
    """A plan built ahead of a step that is then refused is refused with it; a request it admitted did not
    cause that, so it is queued again in front, and later served, not failed."""
    g, reqs = _decode_group(1, 20)
    g.sched.max_num_seqs = 2
    for _ in range(3):
        g.run_step()
    late = Request("late", [9, 9, 9], SamplingParams(), 4)  # nothing to probe: admitted by a plan built ahead
    g.sched.add(late)
    g.run_step(refuse={0: "injected"})  # refused: the plan built meanwhile, admitting `late`, is void
    assert g.ahead is not None and [a.request_id for a in g.ahead.admits] == ["late"] and late in g.sched.running
    g.run_step()
    assert late in g.sched.waiting and late.num_computed == 0
    g.run()
    assert late.finish_reason == "length" and late.generated == reference(late)
    assert reqs[0].generated == reference(reqs[0])
    for r in g.ranks:
        r.assert_idle()


def test_the_arrivals_script_runs_and_every_request_gets_its_reference_tokens():
    """scripts/overlap_arrivals.py, whose numbers the overlap's notes quote: it must not rot."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "overlap_arrivals.py"
    proc = subprocess.run([sys.executable, str(script), "--requests", "12"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("steps planned ahead") == 4


def test_a_plan_built_ahead_always_carries_a_running_request_on():
    """A plan built ahead with admissions only would run even when the step before it was refused (the ranks
    refuse a plan built ahead of a refused step by its pending tokens and chunk starts): none is built."""
    g, reqs = _decode_group(1, 2)
    g.sched.max_num_seqs = 2
    built = []
    plan_ahead = g.sched.plan_ahead

    def recording(step):
        plan = plan_ahead(step)
        built.append(plan)
        return plan

    g.sched.plan_ahead = recording
    g.run_step()  # an empty plan: no reports yet
    g.run_step()  # admits r0, whose one decode, its last token, is then built ahead
    late = Request("late", [9, 9, 9], SamplingParams(), 4)  # nothing to probe: admissible ahead
    g.sched.add(late)  # while the plan in flight samples r0's last token: only `late` is left to plan
    g.run()
    admitted_only = [p for p in built
                     if p is not None and {c.request_id for c in p.batch} <= {a.request_id for a in p.admits}]
    assert not admitted_only
    assert late.generated == reference(late)
    assert reqs[0].generated == reference(reqs[0])


def test_a_partly_refused_step_puts_its_running_requests_back_first_in_their_order():
    """Preempted by a step only some ranks carried out, the running requests go back to the front of the queue in
    the order they ran (first come, first served), not reversed."""
    from dataclasses import replace

    g, reqs = _decode_group(3, 20)
    for _ in range(3):
        g.run_step()
    g.sched.add(Request("late", [9, 9, 9, 9, 9, 9, 9, 9, 9], SamplingParams(), 4))

    def rank1_failed(reports):
        reports[1] = replace(reports[1], error="rank 1: lost its device")

    g.run_step(tamper=rank1_failed)
    assert g.sched.stats.preemptions == 3
    assert [r.request_id for r in g.sched.waiting] == ["r0", "r1", "r2", "late"]


def test_the_admits_of_a_plan_built_ahead_of_a_partly_refused_step_wait_behind_what_that_step_preempted():
    """The plan built ahead of a step only some ranks carried out admitted a request that came later than the
    step's running ones; refused in turn, it puts that request back behind them, not in front (first come, first
    served)."""
    from dataclasses import replace

    g, reqs = _decode_group(3, 20)
    g.sched.max_num_seqs = 4
    for _ in range(3):
        g.run_step()
    g.sched.add(Request("late", [9, 9, 9], SamplingParams(), 4))  # no prefix: admitted by the plan built ahead

    def rank1_failed(reports):
        reports[1] = replace(reports[1], error="rank 1: lost its device")

    g.run_step(tamper=rank1_failed)
    assert [a.request_id for a in g.ahead.admits] == ["late"]
    g.run_step(tamper=rank1_failed)
    assert [r.request_id for r in g.sched.waiting] == ["r0", "r1", "r2", "late"]
