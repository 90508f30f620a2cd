"""Admission control: does a step's work fit on every rank, by the last report of every rank?

A rank's allocation must never fail, and ranks differ (one flushed, one with a smaller pool), so each
rank's headroom is tracked on its own and a step's work is taken only if it fits on all of them. It
counts conservatively: pages that pinning takes out of the evictable set are charged as if no live
request pinned them already, unless the rank said so; pages shared by two requests admitted together
are charged twice; pages a release frees are credited only when the next report shows them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lockstep.kv.paging import first_page, growth_pages, held_pages, pages_for, peak_pages, pool_window
from lockstep.steps import PoolState, ProbeAnswer, Report

DEFERRAL_REASONS = ("pages", "max_num_seqs", "token_budget", "probe_pending", "prefix_pending")  # prefix_sharing.py


def allocatable_pages(report: Report) -> int:
    """Pages rank can hand out now (free + evictable), on its tightest pool since every pool grows."""
    if not report.pools:
        raise ValueError(f"report of rank {report.rank} for step {report.step} has no pool states")
    return min(p.free + p.evictable for p in report.pools)


def pin_takeout(answer: ProbeAnswer | None, agreed: int) -> int:
    """Cached pages that pinning the first `agreed` pages takes out of this rank's evictable set.

    The rank said `pinned` of its `matched` pages are referenced by live requests; at worst those are the
    ones it would not pin, so only pinned - (matched - agreed) of ours are surely out already.
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

    `reports[r]` must be rank r's. Every pool is counted on every rank on its own (a hybrid model's
    `full` and `sliding` pools run out at different times); a step's chunk grows a request by the same
    pages in each pool, since a sliding pool drops the pages its window left only after the step.
    Running requests take their growth first (`grow`), then waiting requests are considered in order
    (`consider`); everything taken stays taken for the step.
    """

    def __init__(
        self,
        reports: Sequence[Report],
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_running: int,
        window: int = 0,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if not reports:
            raise ValueError("admission control needs the last report of every rank")
        for r, report in enumerate(reports):
            if report.rank != r:
                raise ValueError(f"reports must be in rank order: position {r} holds rank {report.rank}")
            allocatable_pages(report)
        names = sorted(p.pool for p in reports[0].pools)
        for report in reports:
            if sorted(p.pool for p in report.pools) != names:
                raise ValueError(f"rank {report.rank} reports pools {sorted(p.pool for p in report.pools)}, "
                                 f"rank 0 reports {names}: the ranks of a group serve the same pools")
        self.page_size = page_size
        self.windows = {name: pool_window(name, window) for name in names}
        self.room = {name: [_pool(r, name).free + _pool(r, name).evictable for r in reports] for name in names}
        self.capacity = {name: [_pool(r, name).total for r in reports] for name in names}
        self.seqs_left = max_num_seqs - num_running
        self.tokens_left = max_num_batched_tokens
        # the most of a step one request's chunk takes (vLLM's long_prefill_token_threshold; 0: the whole budget)
        self.chunk_tokens = long_prefill_token_threshold or max_num_batched_tokens
        self._start = {name: list(room) for name, room in self.room.items()}
        self._overdrawn = False  # some room below zero (only `charge` can make it so): no page-free shortcut

    def charge(self, spent: Mapping[str, Sequence[int]]) -> None:
        """Count the pages a plan still in flight takes (for a plan built ahead of that plan's reports)."""
        for name, pages in spent.items():
            self.room[name] = [h - p for h, p in zip(self.room[name], pages, strict=True)]
        self._start = {name: list(room) for name, room in self.room.items()}
        self._overdrawn = any(h < 0 for room in self.room.values() for h in room)

    def spent(self) -> dict[str, list[int]]:
        """Pages this step took in each pool of each rank: what a plan built ahead of its reports charges."""
        return {name: [a - b for a, b in zip(self._start[name], room, strict=True)] for name, room in self.room.items()}

    @property
    def ranks(self) -> int:
        return len(next(iter(self.room.values())))

    @property
    def headroom(self) -> list[int]:
        """Pages each rank can still give in its tightest pool."""
        return [min(room[r] for room in self.room.values()) for r in range(self.ranks)]

    def too_large(self, max_positions: int) -> str:
        """Why a request of up to max_positions positions can never run here ("" when it can): the most
        it holds at once must fit alone in each pool of every rank."""
        for name, window in self.windows.items():
            need = peak_pages(window, self.page_size, max_positions)
            smallest = min(self.capacity[name])
            if need > smallest:
                return f"needs up to {need} KV pages of pool {name!r} but the smallest rank pool holds {smallest}"
        return ""

    def take(self, pages: Sequence[int] | Mapping[str, Sequence[int]], num_tokens: int = 0, seqs: int = 0) -> None:
        """Spend pages[r] on rank r (per pool when a mapping, else the same in every pool)."""
        by_pool = pages if isinstance(pages, Mapping) else dict.fromkeys(self.room, pages)
        for name, need in by_pool.items():
            if not fits(need, self.room[name]):
                raise ValueError(f"taking {list(need)} pages overdraws headroom {self.room[name]} of pool {name!r}")
        for name, need in by_pool.items():
            self.room[name] = [h - p for h, p in zip(self.room[name], need, strict=True)]
        self.tokens_left -= num_tokens
        self.seqs_left -= seqs

    def grow(self, num_computed: int, num_tokens: int) -> int:
        """Take the most of num_tokens a running request can compute now on every rank; how many (0: none).

        The token budget may cut a chunk short; so may pages, since a prefill chunk that stops at the last
        page every rank can give still makes progress.
        """
        n = min(num_tokens, self.tokens_left, self.chunk_tokens)
        if n <= 0:
            return 0
        ps = self.page_size
        if -(-(num_computed + n) // ps) == -(-num_computed // ps) and not self._overdrawn:
            self.tokens_left -= n  # within the pages it holds (most decodes): nothing to count per rank
            return n
        if n == 1 and num_computed % ps == 0:
            return self._grow_into_page()
        pages = min(self.headroom)
        n = min(n, (pages_for(num_computed, self.page_size) + pages) * self.page_size - num_computed)
        if n <= 0:
            return 0
        self.take([growth_pages(num_computed, n, self.page_size)] * self.ranks, n)
        return n

    def _grow_into_page(self) -> int:
        """`grow` of a decode whose position starts a new page (one decode in page_size): one page on every rank
        of every pool, or nothing; what the general case comes to, without its per-rank lists (3.7 against
        1 us, and a plan at batch 256 of 16-token pages has some 16 of them)."""
        room = self.room
        if min(map(min, room.values())) <= 0:
            return 0
        for name, pages in room.items():
            room[name] = [h - 1 for h in pages]
        self.tokens_left -= 1
        return 1

    def grow_in_page(self, num_computed: int) -> bool:
        """`grow(num_computed, 1) == 1` where that takes no page: a decode whose position lies in a page the request
        holds, with budget left. False leaves everything as it was (then `grow` decides, counting pages)."""
        if num_computed % self.page_size and self.tokens_left > 0 and not self._overdrawn:
            self.tokens_left -= 1
            return True
        return False

    def shortfall(self, num_computed: int, num_tokens: int) -> dict[str, int]:
        """Pages missing in each pool on its worst rank to compute num_tokens more (within the token budget)."""
        n = min(num_tokens, max(self.tokens_left, 1), self.chunk_tokens)
        need = growth_pages(num_computed, n, self.page_size)
        return {name: max(0, max(need - h for h in room)) for name, room in self.room.items()}

    def held(self, num_computed: int) -> dict[str, int]:
        """Pages a running request of num_computed positions holds in each pool: what preempting it frees."""
        return {name: held_pages(num_computed, w, self.page_size) for name, w in self.windows.items()}

    def consider(
        self,
        num_tokens: int,
        agreed: int,
        answers: Sequence[ProbeAnswer | None] = (),
        probe_ready: bool = True,
    ) -> Decision:
        """Admit a waiting request of num_tokens tokens whose first `agreed` pages every rank can serve?

        It needs, in each pool of each rank, the new pages of its first chunk beyond the prefix plus the
        cached pages pinning takes out of that pool's evictable set; admitted, those are taken.
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
        n = min(num_tokens - prefix, self.tokens_left, self.chunk_tokens, self._alone(agreed) * self.page_size)
        if n <= 0:
            return Decision(False, "pages", 0, (), None)
        new = growth_pages(prefix, n, self.page_size)
        need = {
            name: [new + self._takeout(name, answers[r] if r < len(answers) else None, agreed)
                   for r in range(self.ranks)]
            for name in self.room
        }
        worst_need = tuple(max(need[name][r] for name in need) for r in range(self.ranks))
        short = {name: [need[name][r] - self.room[name][r] for r in range(self.ranks)] for name in need}
        if any(x > 0 for v in short.values() for x in v):
            worst = max(range(self.ranks), key=lambda r: max(v[r] for v in short.values()))
            return Decision(False, "pages", n, worst_need, worst)
        self.take(need, n, 1)
        return Decision(True, num_tokens=n, pages=worst_need)

    def _alone(self, agreed: int) -> int:
        """New pages a first chunk after `agreed` prefix pages may take so that it could fit alone in every
        pool of every rank: a sliding pool is sized for windows, not for a long prompt in one chunk."""
        return min((min(self.capacity[name]) - self._pins(name, agreed) for name, w in self.windows.items() if w),
                   default=1 << 62)

    def _pins(self, name: str, agreed: int) -> int:
        """Pages of pool `name` that pinning `agreed` prefix pages holds."""
        window = self.windows[name]
        return agreed if window is None else agreed - first_page(agreed * self.page_size, window, self.page_size)

    def _takeout(self, name: str, answer: ProbeAnswer | None, agreed: int) -> int:
        window = self.windows[name]
        if window is None:
            return pin_takeout(answer, agreed)
        pins = self._pins(name, agreed)
        if answer is None:
            return pins
        return pin_takeout(ProbeAnswer(answer.request_id, answer.sliding_held, answer.sliding_pinned), pins)


def _pool(report: Report, name: str) -> PoolState:
    return next(p for p in report.pools if p.pool == name)
