"""The agreement wait of one step: which ranks have reported, and how long the others have been silent.

Pure bookkeeping with time passed in, so the service layer decides when to look and the stall metric,
the log line naming the silent ranks and the dead-rank timeout all read the same state.
"""

from __future__ import annotations

from collections.abc import Iterable

from lockstep.steps import Report


class AgreementWait:
    """Reports of plan `step` from `ranks` (a count, or the ranks themselves), started at `started_at`."""

    def __init__(self, step: int, ranks: int | Iterable[int], started_at: float) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if isinstance(ranks, int):
            ranks = range(ranks)
        self.ranks = sorted(set(ranks))
        if not self.ranks or any(type(r) is not int or r < 0 for r in self.ranks):
            raise ValueError(f"an agreement wait needs at least one rank (ints >= 0), got {self.ranks!r}")
        self.step = step
        self.started_at = started_at
        self._got: dict[int, Report] = {}

    def record(self, report: Report) -> bool:
        """Keep the first report of each rank for this step; False for a duplicate or another step's."""
        if report.rank not in self.ranks:
            raise ValueError(f"report from rank {report.rank!r}, but this group's ranks are {self.ranks}")
        if report.step != self.step or report.rank in self._got:
            return False
        self._got[report.rank] = report
        return True

    def missing(self) -> list[int]:
        return [r for r in self.ranks if r not in self._got]

    @property
    def done(self) -> bool:
        return len(self._got) == len(self.ranks)

    def reports(self) -> list[Report]:
        """The reports in rank order; only once every rank has answered."""
        if not self.done:
            raise RuntimeError(f"step {self.step}: ranks {self.missing()} have not reported yet")
        return [self._got[r] for r in self.ranks]

    def elapsed(self, now: float) -> float:
        return max(0.0, now - self.started_at)

    def stalled(self, now: float, threshold: float) -> bool:
        """Still waiting after longer than `threshold` seconds."""
        return not self.done and self.elapsed(now) > threshold

    def dead(self, now: float, timeout: float) -> list[int]:
        """The ranks still silent after `timeout` seconds (empty before that, or once all answered)."""
        if self.done or self.elapsed(now) <= timeout:
            return []
        return self.missing()
