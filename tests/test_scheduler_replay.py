"""The scheduler when a group goes down: every request is kept, with its tokens, and a fresh or another
group finishes it with the tokens of an undisturbed run (simulated ranks, `sim_ranks`)."""

from __future__ import annotations

import pytest

from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import PREEMPTED
from lockstep.steps import Report
from sim_ranks import Group, make_sched, reference


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
    b_sched.adopt([req])
    with pytest.raises(ValueError, match="already in use"):
        b_sched.adopt([req])
    b.run_step()
    b.run_step()
    first = next(c for p in b.plans for c in p.batch if c.request_id == "r")
    assert first.start == 0 and first.token_ids == tuple(range(1, 11)) + tuple(kept)
    assert first.sample and first.sample_index == len(kept)
    b.run()
    assert req.generated[: len(kept)] == kept and req.generated == reference(req)


def test_adopted_requests_keep_their_arrival_order_ahead_of_waiting_ones():
    """Bug fix: a group's requests moved to another one were adopted one at a time, each in front, so they
    were served newest first."""
    a_sched = make_sched(budget=64, caching=False)
    olds = [Request(f"old{i}", list(range(1 + i, 11 + i)), max_tokens=4) for i in range(3)]
    for r in olds:
        a_sched.add(r)
    a_sched.requeue_all()
    b_sched = make_sched(budget=64, max_model_len=128)
    b_sched.add(Request("new", list(range(40, 50)), max_tokens=4))
    b_sched.adopt(list(a_sched.requests.values()))
    assert [r.request_id for r in b_sched.waiting] == ["old0", "old1", "old2", "new"]
    too_long = Request("long", list(range(1, 11)), max_tokens=10_000)
    with pytest.raises(ValueError, match="exceed the model's"):
        b_sched.adopt([too_long])
    assert [r.request_id for r in b_sched.waiting] == ["old0", "old1", "old2", "new"]  # all or none


def test_an_error_report_without_pools_does_not_stop_the_next_plan():
    """Bug fix: a rank that refuses a plan it could not read reports no pool states; the next plan raised
    "has no pool states" and the group's loop failed. The rank's last known pools stand in."""
    sched = make_sched(ranks=2, caching=False)
    g = Group(sched, [30, 30], caching=False)
    req = Request("a", [1, 2, 3], max_tokens=6)
    sched.add(req)
    g.run_step()
    g.run_step()
    plan = sched.plan(g.step, g.reports)
    reports = [Report(plan.step, 0, error="another rank of the group refused this step", pools=g.reports[0].pools),
               Report(plan.step, 1, error="out of order: expected step 3, got 4")]  # no pools
    sched.apply(reports)
    nxt = sched.plan(plan.step + 1, reports)
    assert [c.request_id for c in nxt.batch] == ["a"]  # planned again as it was, from the last known pools
    fresh = make_sched(ranks=2, caching=False)
    fresh.add(Request("b", [1, 2], max_tokens=2))
    fresh.plan(0, [])
    fresh.apply([Report(0, r, error="unreadable plan") for r in range(2)])
    assert fresh.plan(1, [Report(0, r, error="unreadable plan") for r in range(2)]).batch == ()  # none known yet


def test_hand_over_gives_every_request_to_another_group_that_finishes_it_undisturbed():
    """A drain with migrate: between two plans every request leaves this group (the running ones released
    by its next plan) and another group adopts them, oldest first, and finishes them with the tokens of an
    undisturbed run."""
    a_sched = make_sched(budget=32, seqs=2, caching=False)
    a = Group(a_sched, [64], caching=False)
    reqs = [Request(f"m{i}", list(range(1 + i, 9 + i)), max_tokens=10) for i in range(3)]
    for r in reqs:
        a_sched.add(r)
    for _ in range(4):
        a.run_step()
    moved = a_sched.hand_over()
    assert [r.request_id for r in moved] == ["m0", "m1", "m2"] and not a_sched.requests
    plan = a_sched.plan(a.step, a.reports)
    assert set(plan.releases) == {"m0", "m1"} and not plan.batch  # released on the old ranks
    b_sched = make_sched(budget=32, seqs=4)
    b = Group(b_sched, [64])
    b_sched.adopt(moved)
    b.run()
    assert all(r.generated == reference(r) for r in reqs)
