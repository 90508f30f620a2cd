"""The agreement wait: who has reported, duplicates, stalls and dead ranks, on a clock passed in."""

from __future__ import annotations

import pytest

from lockstep.coordinator.waits import AgreementWait
from lockstep.steps import Report


def test_done_only_when_every_rank_reported_once():
    wait = AgreementWait(4, 3, started_at=100.0)
    assert wait.missing() == [0, 1, 2] and not wait.done
    assert wait.record(Report(step=4, rank=2))
    assert wait.record(Report(step=4, rank=0))
    assert wait.missing() == [1] and not wait.done
    with pytest.raises(RuntimeError, match=r"ranks \[1\] have not reported"):
        wait.reports()
    assert wait.record(Report(step=4, rank=1))
    assert wait.done and wait.missing() == []
    assert [r.rank for r in wait.reports()] == [0, 1, 2]


def test_duplicates_and_other_steps_are_refused():
    wait = AgreementWait(4, [0, 1], started_at=0.0)
    first = Report(step=4, rank=0, error="")
    assert wait.record(first)
    assert not wait.record(Report(step=4, rank=0, error="late duplicate"))
    assert not wait.record(Report(step=3, rank=1))  # the previous step's report, delivered again
    assert not wait.record(Report(step=5, rank=1))
    assert wait.missing() == [1]
    wait.record(Report(step=4, rank=1))
    assert wait.reports()[0] is first


def test_a_rank_outside_the_group_is_an_error():
    wait = AgreementWait(0, 2, started_at=0.0)
    with pytest.raises(ValueError, match=r"rank 2, but this group's ranks are \[0, 1\]"):
        wait.record(Report(step=0, rank=2))
    with pytest.raises(ValueError, match="at least one rank"):
        AgreementWait(0, 0, started_at=0.0)
    with pytest.raises(ValueError, match="step"):
        AgreementWait(-1, 1, started_at=0.0)


def test_stalled_after_the_threshold_while_a_rank_is_silent():
    wait = AgreementWait(1, 2, started_at=10.0)
    wait.record(Report(step=1, rank=0))
    assert not wait.stalled(14.9, threshold=5.0)
    assert not wait.stalled(15.0, threshold=5.0)
    assert wait.stalled(15.1, threshold=5.0)
    assert wait.elapsed(15.5) == pytest.approx(5.5)
    wait.record(Report(step=1, rank=1))
    assert not wait.stalled(100.0, threshold=5.0)


def test_dead_names_the_silent_ranks_only_past_the_timeout():
    wait = AgreementWait(2, 4, started_at=0.0)
    wait.record(Report(step=2, rank=1))
    wait.record(Report(step=2, rank=3))
    assert wait.dead(29.0, timeout=30.0) == []
    assert wait.dead(30.5, timeout=30.0) == [0, 2]
    wait.record(Report(step=2, rank=0))
    wait.record(Report(step=2, rank=2))
    assert wait.dead(1000.0, timeout=30.0) == []


def test_a_clock_that_steps_back_never_counts_negative_time():
    wait = AgreementWait(0, 1, started_at=50.0)
    assert wait.elapsed(40.0) == 0.0
    assert not wait.stalled(40.0, threshold=0.0)


def test_one_step_behind_names_the_ranks_a_dead_coordinator_left_behind():
    from lockstep.coordinator.group_ranks import one_step_behind
    from lockstep.steps import RankInfo

    def infos(*steps: int) -> list[RankInfo]:
        return [RankInfo(r, len(steps), "m", 16, (("full", 8),), 64, 100, s) for r, s in enumerate(steps)]

    assert one_step_behind(infos(7, 6, 7)) == (7, [1])
    assert one_step_behind(infos(6, 6, 7)) == (7, [0, 1])
    assert one_step_behind(infos(7, 7)) == (-1, [])  # in step
    assert one_step_behind(infos(5, 7)) == (-1, [])  # two apart: not a dead coordinator's doing
    assert one_step_behind(infos(-1, 0)) == (0, [0])
