"""The step protocol's own rules and types: the delivery gate, frozen reports, rank infos."""

from __future__ import annotations

import dataclasses

import pytest

from lockstep.steps import Admit, Plan, PoolState, RankInfo, Report, Sampled, StepGate, Timings


class Recorder:
    """A rank behind a StepGate: what it ran and what it refused."""

    def __init__(self) -> None:
        self.gate = StepGate(0)
        self.ran: list[int] = []
        self.refused: list[str] = []

    def run(self, plan: Plan) -> Report:
        self.ran.append(plan.step)
        return Report(step=plan.step, rank=0, sampled=(Sampled("a", len(self.ran)),))

    def refuse(self, plan: Plan, why: str) -> Report:
        self.refused.append(why)
        return Report(step=plan.step, rank=0, error=why)

    def deliver(self, plan: Plan) -> Report:
        return self.gate.deliver(plan, self.run, self.refuse)


def test_a_plan_delivered_again_is_answered_from_its_report_and_run_once():
    r = Recorder()
    assert r.gate.last_step == -1
    plan = Plan(step=7, admits=(Admit("a"),))
    first = r.deliver(plan)
    assert r.deliver(Plan(step=7, admits=(Admit("a"),))) is first
    assert r.ran == [7] and r.refused == [] and r.gate.last_step == 7


@pytest.mark.parametrize(
    "step, words",
    [
        (7, "step 7 was already carried out with a different plan"),
        (9, "out of order: expected step 8 (or 7 again), got 9"),
        (6, "out of order: expected step 8 (or 7 again), got 6"),
    ],
)
def test_a_conflicting_or_out_of_order_plan_is_refused_without_running(step, words):
    r = Recorder()
    r.deliver(Plan(step=7, admits=(Admit("a"),)))
    report = r.deliver(Plan(step=step))
    assert report.error == words and r.ran == [7] and r.gate.last_step == 7
    assert not r.deliver(Plan(step=8)).error and r.ran == [7, 8]


def test_report_is_frozen_and_keeps_tuples():
    report = Report(step=1, rank=0, pools=[PoolState("full", 4, 4, 0, 0)], timings=Timings(step_s=0.1))
    assert report.pools == (PoolState("full", 4, 4, 0, 0),) and report.sampled == ()
    assert report == Report(step=1, rank=0, pools=(PoolState("full", 4, 4, 0, 0),), timings=Timings(step_s=0.1))
    hash(report)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.error = "changed"  # type: ignore[misc]


def test_rank_info_keeps_its_pools_sorted_and_is_frozen():
    a = RankInfo(0, 1, "m", 16, {"sliding": 2, "full": 8}, 128, 100)
    b = RankInfo(0, 1, "m", 16, (("full", 8), ("sliding", 2)), 128, 100)
    assert a == b and a.pools == (("full", 8), ("sliding", 2)) and a.pool_totals == {"full": 8, "sliding": 2}
    assert a.last_step == -1 and dataclasses.replace(a, last_step=5).last_step == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rank = 1  # type: ignore[misc]
