"""Admission control: does a step's work fit on every rank, by the last report of every rank?

A rank's allocation must never fail, and ranks differ (one flushed, one with a smaller pool), so each
rank's headroom is tracked on its own and a step's work is taken only if it fits on all of them. It
counts conservatively: pages that pinning takes out of the evictable set are charged as if no live
request pinned them already, unless the rank said so; pages shared by two requests admitted together
are charged twice; pages a release frees are credited only when the next report shows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockstep.kv.paging import growth_pages, pages_for
from lockstep.steps import ProbeAnswer, Report

DEFERRAL_REASONS = ("pages", "max_num_seqs", "token_budget", "probe_pending")


def allocatable_pages(report: Report) -> int:
    """Pages rank can hand out now (free + evictable), on its tightest pool since every pool grows."""
    if not report.pools:
        raise ValueError(f"report of rank {report.rank} for step {report.step} has no pool states")
    return min(p.free + p.evictable for p in report.pools)


def capacity_pages(report: Report) -> int:
    """The most pages one request can ever hold on this rank."""
    if not report.pools:
        raise ValueError(f"report of rank {report.rank} for step {report.step} has no pool states")
    return min(p.total for p in report.pools)


def pin_takeout(answer: ProbeAnswer | None, agreed: int) -> int:
    """Cached pages that pinning the first `agreed` pages takes out of this rank's evictable set.

    The rank said `pinned` of its `matched` leading pages are referenced by live requests; at worst those
    are the ones past `agreed`, so only pinned - (matched - agreed) of ours are surely out already.
    """
    if agreed <= 0:
        return 0
    if answer is None:
        return agreed
    surely_pinned = max(0, answer.pinned_pages - max(0, answer.matched_pages - agreed))
    return agreed - min(agreed, surely_pinned)


def fits(need: Sequence[int], headroom: Sequence[int]) -> bool:
    """Whether need[r] pages fit in headroom[r] on every rank."""
    if len(need) != len(headroom):
        raise ValueError(f"need for {len(need)} ranks against headroom of {len(headroom)}")
    return all(n <= h for n, h in zip(need, headroom, strict=True))


@dataclass(frozen=True)
class Decision:
    """Admit (with its first chunk's length and the pages it takes per rank) or defer with a reason."""

    admit: bool
    reason: str = ""
    num_tokens: int = 0
    pages: tuple[int, ...] = ()
    rank: int | None = None

    def __post_init__(self) -> None:
        if not self.admit and self.reason not in DEFERRAL_REASONS:
            raise ValueError(f"a deferral needs a reason in {DEFERRAL_REASONS}, got {self.reason!r}")


class AdmissionControl:
    """The page, sequence and token budget of one step, from the last report of every rank.

    `reports[r]` must be rank r's. Running requests take their growth first (`grow`), then waiting
    requests are considered in order (`consider`); everything taken stays taken for the step.
    """

    def __init__(
        self,
        reports: Sequence[Report],
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_running: int,
    ) -> None:
        if not reports:
            raise ValueError("admission control needs the last report of every rank")
        for r, report in enumerate(reports):
            if report.rank != r:
                raise ValueError(f"reports must be in rank order: position {r} holds rank {report.rank}")
        self.page_size = page_size
        self.headroom = [allocatable_pages(r) for r in reports]
        self.capacity = [capacity_pages(r) for r in reports]
        self.seqs_left = max_num_seqs - num_running
        self.tokens_left = max_num_batched_tokens

    @property
    def ranks(self) -> int:
        return len(self.headroom)

    def largest_request_pages(self) -> int:
        """Pages a request may need in all: the smallest pool's size (it must fit alone on every rank)."""
        return min(self.capacity)

    def take(self, pages: Sequence[int], num_tokens: int = 0, seqs: int = 0) -> None:
        if not fits(pages, self.headroom):
            raise ValueError(f"taking {list(pages)} pages overdraws headroom {self.headroom}")
        self.headroom = [h - p for h, p in zip(self.headroom, pages, strict=True)]
        self.tokens_left -= num_tokens
        self.seqs_left -= seqs

    def grow(self, num_computed: int, num_tokens: int) -> int:
        """Take the most of num_tokens a running request can compute now on every rank; how many (0: none).

        The token budget may cut a chunk short; so may pages, since a prefill chunk that stops at the last
        page every rank can give still makes progress.
        """
        n = min(num_tokens, self.tokens_left)
        if n <= 0:
            return 0
        pages = min(self.headroom)
        n = min(n, (pages_for(num_computed, self.page_size) + pages) * self.page_size - num_computed)
        if n <= 0:
            return 0
        self.take([growth_pages(num_computed, n, self.page_size)] * self.ranks, n)
        return n

    def shortfall(self, num_computed: int, num_tokens: int) -> int:
        """Pages missing on the worst rank to compute num_tokens more (within the token budget)."""
        n = min(num_tokens, max(self.tokens_left, 1))
        need = growth_pages(num_computed, n, self.page_size)
        return max(0, max(need - h for h in self.headroom))

    def consider(
        self,
        num_tokens: int,
        agreed: int,
        answers: Sequence[ProbeAnswer | None] = (),
        probe_ready: bool = True,
    ) -> Decision:
        """Admit a waiting request of num_tokens tokens whose first `agreed` pages are cached on every rank?

        It needs, on each rank, the new pages of its first chunk beyond the prefix plus the cached pages
        pinning takes out of that rank's evictable set; admitted, those are taken.
        """
        if self.seqs_left <= 0:
            return Decision(False, "max_num_seqs")
        if self.tokens_left <= 0:
            return Decision(False, "token_budget")
        if not probe_ready:
            return Decision(False, "probe_pending")
        prefix = agreed * self.page_size
        if not 0 <= prefix < num_tokens:
            raise ValueError(f"agreed prefix of {agreed} pages must leave a token of {num_tokens} to compute")
        n = min(num_tokens - prefix, self.tokens_left)
        new = growth_pages(prefix, n, self.page_size)
        need = [
            new + pin_takeout(answers[r] if r < len(answers) else None, agreed) for r in range(self.ranks)
        ]
        if not fits(need, self.headroom):
            worst = max(range(self.ranks), key=lambda r: need[r] - self.headroom[r])
            return Decision(False, "pages", n, tuple(need), worst)
        self.take(need, n, 1)
        return Decision(True, num_tokens=n, pages=tuple(need))
