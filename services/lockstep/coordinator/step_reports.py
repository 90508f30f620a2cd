"""The reports of one step as the scheduler takes them: one per rank, all of one step, pools known."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from operator import attrgetter

from lockstep.steps import PoolState, Report, Sampled

_REQUEST_ID = attrgetter("request_id")


def in_rank_order(reports: Sequence[Report], ranks: int) -> list[Report]:
    """The reports of ranks 0..ranks-1 in rank order; ValueError unless there is exactly one from each rank
    and all are of one step."""
    by_rank: dict[int, Report] = {}
    for report in reports:
        if not isinstance(report.rank, int) or not 0 <= report.rank < ranks:
            raise ValueError(f"report from rank {report.rank!r}; this group has ranks 0..{ranks - 1}")
        if report.rank in by_rank:
            raise ValueError(f"two reports from rank {report.rank}")
        by_rank[report.rank] = report
    if len(by_rank) != ranks:
        missing = sorted(set(range(ranks)) - by_rank.keys())
        raise ValueError(f"reports of every rank are needed; ranks {missing} are missing")
    steps = {r.step for r in reports}
    if len(steps) != 1:
        raise ValueError(f"reports of different steps mixed: {sorted(steps)}")
    return [by_rank[r] for r in range(ranks)]


class LastPools:
    """Each rank's last reported pool states, standing in where an error report carries none.

    A rank that refuses a plan it could not read reports no pools. Its last known ones can only overstate
    what it holds, since a refused step allocates nothing and its releases free pages.
    """

    def __init__(self) -> None:
        self._pools: dict[int, tuple[PoolState, ...]] = {}

    def fill(self, reports: list[Report]) -> list[Report]:
        """The reports with pools everywhere; [] (schedule nothing) while some rank's are not known yet."""
        out = []
        for report in reports:
            if report.pools:
                self._pools[report.rank] = report.pools
            elif report.rank in self._pools:
                report = replace(report, pools=self._pools[report.rank])
            else:
                return []
            out.append(report)
        return out


def plan_reports(step: int, reports: Sequence[Report], last_step: int | None, ranks: int) -> list[Report]:
    """The reports plan `step` is built from, in rank order; ValueError unless they are every rank's
    reports of the last planned step `last_step` (none before the first plan) and `step` comes after it."""
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if last_step is not None and step <= last_step:
        raise ValueError(f"step {step} must come after the last planned step {last_step}")
    if not reports:
        if last_step is not None:
            raise ValueError(f"plan {step} needs the reports of step {last_step}")
        return []
    ordered = in_rank_order(reports, ranks)
    if last_step is not None and ordered[0].step != last_step:
        raise ValueError(f"plan {step} must be built from the reports of step {last_step}")
    if ordered[0].step >= step:
        raise ValueError(f"plan {step} cannot be built from reports of step {ordered[0].step}")
    return ordered


def sampled_by_request(reports: Sequence[Report]) -> dict[str, Sampled]:
    """Each request's sampled token, the first rank's where several sampled it. One report (tp 1, or the one rank
    that samples): a dict of its tuple in C, not a comprehension over the step's 256 tokens."""
    if len(reports) == 1:
        got = reports[0].sampled
        return dict(zip(map(_REQUEST_ID, got), got, strict=True))
    return {s.request_id: s for report in reversed(reports) for s in report.sampled}
