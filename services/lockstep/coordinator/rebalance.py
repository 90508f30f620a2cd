"""The rebalance decision: when a group moves the split of its KV budget between the `full` and `sliding`
pools, and to which exact split. Pure: the coordinator's clock and the ranks' reports come in as values.

Seed 001 is the catalogue this avoids: a trigger counted by a private counter that a skipped step offsets,
a cooldown read from each rank's own clock, an agreement skipped on one dimension. Here the decision is
made once per group, by the coordinator, from every rank's report: checked at plan steps that are a
multiple of the interval (the step index, never a counter), after the cooldown on the coordinator's own
clock, once enough finished requests were sampled; sent in a plan that carries nothing else, so a rank
that cannot take it refuses and every rank undoes it together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lockstep.kv.paging import POOL_FULL, POOL_SLIDING, pages_for, peak_pages
from lockstep.steps import Report

Split = dict[str, int]


@dataclass(frozen=True)
class Move:
    """What a rebalance plan carries: a new split (every pool's total), or a fence on the pool about to
    shrink (its pages at or above the fence are not handed out, so the ones held there drain)."""

    split: Split | None = None
    fence: Split | None = None
    lift: bool = False  # the fence is lifted (its level is the largest total: nothing fenced anywhere)


@dataclass(frozen=True)
class RebalancePolicy:
    """When to check (defaults in the spirit of TensorRT-LLM's: every 10 steps, 120 s apart, after 2000
    finished requests, when a pool is off its target by more than 1.25x)."""

    enabled: bool = True
    interval_steps: int = 10
    cooldown_s: float = 120.0
    min_samples: int = 2000
    threshold: float = 1.25
    min_move: float = 0.02  # a clamped move below this share of the shrinking pool waits for a better time
    fence_checks: int = 30  # checks a fence may wait for its pages to drain before a partial move lifts it

    def __post_init__(self) -> None:
        if type(self.interval_steps) is not int or self.interval_steps < 1:
            raise ValueError(f"rebalance interval must be an integer >= 1 step, got {self.interval_steps!r}")
        if not self.cooldown_s >= 0 or self.min_samples < 0:
            raise ValueError("rebalance cooldown and minimum samples must be >= 0")
        if not self.threshold >= 1.0:
            raise ValueError(f"rebalance threshold is a ratio >= 1.0, got {self.threshold!r}")


def request_pages(positions: int, page_size: int, window: int) -> Split:
    """The most pages a request of `positions` positions held in each pool over its life."""
    return {POOL_FULL: pages_for(positions, page_size), POOL_SLIDING: peak_pages(window, page_size, positions)}


def target_split(uses: Sequence[Mapping[str, int]], budget: int, cost: Mapping[str, int],
                 floors: Mapping[str, int]) -> Split:
    """The split of `budget` bytes under which the sampled requests' pages run out in both pools together
    (the mean request's pages in the ratio of the pools), no pool below its floor."""
    need = {p: sum(u[p] for u in uses) for p in (POOL_FULL, POOL_SLIDING)}
    per_unit = sum(need[p] * cost[p] for p in need)
    full = int(budget * need[POOL_FULL] / per_unit) if per_unit else floors[POOL_FULL]
    most = (budget - floors[POOL_SLIDING] * cost[POOL_SLIDING]) // cost[POOL_FULL]  # the sliding floor wins
    full = min(max(floors[POOL_FULL], full), most)
    return {POOL_FULL: full, POOL_SLIDING: (budget - full * cost[POOL_FULL]) // cost[POOL_SLIDING]}


def off_by(current: Mapping[str, int], target: Mapping[str, int]) -> float:
    """How far the current split is from the target: the largest ratio of one pool's sizes, >= 1."""
    return max(max(current[p], target[p]) / max(1, min(current[p], target[p])) for p in target)


def clamp(target: Split, reports: Sequence[Report], cost: Mapping[str, int], min_move: float,
          budget: int | None = None) -> Split | None:
    """The move toward `target` that every rank can take now, or None when it is too small to matter.

    One split goes to every rank, so it must fit the smallest budget (`budget` bytes, by default the smallest
    rank's pools now); a pool may shrink on a rank only by the pages that rank says it can give up (`movable`:
    the top of the pool that no live request holds).
    """
    pools = [{p.pool: p for p in r.pools} for r in reports]
    base = current_split(reports)
    shrink = _shrinking(target, reports)
    grow = POOL_SLIDING if shrink == POOL_FULL else POOL_FULL
    size = max(target[shrink], _lowest(reports, shrink))
    budget = _budget(reports, cost) if budget is None else budget
    split = {shrink: size, grow: (budget - size * cost[shrink]) // cost[grow]}
    if any(ps[p].total - split[p] > ps[p].movable for ps in pools for p in split):
        return None  # some rank would have to give up pages a live request holds
    if base[shrink] - size < max(1, min_move * base[shrink]) or split[grow] <= base[grow]:
        return None  # too small to matter, or the pages given up do not make one page of the other pool
    return split


def current_split(reports: Sequence[Report]) -> Split:
    """Each pool's total on the rank where it is smallest: what admission can count on everywhere. Equal on every
    rank after a split; before the first one the ranks may differ (--rank-kv-pages), and no one rank stands for
    the others."""
    out: Split = {}
    for r in reports:
        for q in r.pools:
            out[q.pool] = min(out.get(q.pool, q.total), q.total)
    return out


class Rebalancer:
    """One group's rebalance trigger: what finished requests used, and when and where to move the split."""

    def __init__(self, policy: RebalancePolicy, page_size: int, window: int, cost: Mapping[str, int],
                 max_model_len: int) -> None:
        if set(cost) != {POOL_FULL, POOL_SLIDING} or window < 1:
            raise ValueError(f"a rebalance needs a full and a sliding pool and a window, got {dict(cost)} / {window}")
        self.policy = policy
        self.page_size = page_size
        self.window = window
        self.cost = dict(cost)
        # never shrink below what one request of the model's whole context needs alone (where a split can hold it)
        self.floors = request_pages(max_model_len, page_size, window)
        self.uses: deque[Split] = deque(maxlen=max(1, policy.min_samples))  # the most recent: the workload now
        self.last_time: float | None = None
        self.refused: set[tuple[tuple[str, int], ...]] = set()
        self.reason = ""
        self.target: Split = {}  # the split a fence is preparing
        self.fence: Split | None = None  # the fence up on the ranks, {pool: level}
        self.fence_checks = 0
        # the group's budget in bytes: the smallest rank's pools as the group came up. Read again from the pools
        # after each split it would shrink by what the split's rounding left over (under one page of the pool
        # that grew), rebalance after rebalance, for the life of the group.
        self.budget = 0

    def sample(self, positions: int) -> None:
        """A request finished after holding `positions` positions."""
        self.uses.append(request_pages(positions, self.page_size, self.window))

    def checks_at(self, step: int) -> bool:
        """Whether `decide` may move anything at `step`: at no other step can a plan built ahead of its reports
        (overlap) miss a rebalance."""
        return self.policy.enabled and step % self.policy.interval_steps == 0

    def decide(self, step: int, now: float, reports: Sequence[Report]) -> Move | None:
        """What plan `step` carries out, or None (no check due, or no move worth it now).

        When the pages held at the top of the pool to shrink keep the move short of its target, the pool is
        fenced first: nothing new is handed out above the target, and once what is held there has drained
        (or after `fence_checks` checks, with what can be moved then) the split follows.
        """
        p = self.policy
        if not reports or not self.checks_at(step):
            return None
        self.budget = max(self.budget, _budget(reports, self.cost))  # only the splits move the pools' totals
        if self.fence is not None:
            return self._after_fence(reports)
        if self.last_time is not None and now - self.last_time < p.cooldown_s:
            return None
        if len(self.uses) < max(1, p.min_samples):
            return None
        budget = self.budget
        target = target_split(self.uses, budget, self.cost, self._floors(budget))
        if off_by(current_split(reports), target) <= p.threshold:
            return None
        self.reason = (f"{len(self.uses)} finished requests held {_mean(self.uses, POOL_FULL):.1f} full and "
                       f"{_mean(self.uses, POOL_SLIDING):.1f} sliding pages on average; target {target}")
        shrink = _shrinking(target, reports)
        if _lowest(reports, shrink) > target[shrink]:
            self.target = target
            return Move(fence={shrink: target[shrink]})
        split = clamp(target, reports, self.cost, p.min_move, self.budget)
        if split is None or tuple(sorted(split.items())) in self.refused:
            return None
        return Move(split=split)

    def _floors(self, budget: int) -> Split:
        """The model's floors (one request of its whole context, alone) where the budget holds both; else the longest
        request sampled, so that every request like those seen still fits. Held to the model's floors, a budget that
        cannot hold them went to the full pool whole, the sliding pool kept one request's window, and requests
        ran one at a time."""
        if sum(self.floors[p] * self.cost[p] for p in self.floors) <= budget:
            return self.floors
        return {p: min(self.floors[p], max(u[p] for u in self.uses)) for p in self.floors}

    def _after_fence(self, reports: Sequence[Report]) -> Move | None:
        """The split once the fenced pages drained; after too many checks, what can move then."""
        (shrink, level), = self.fence.items()
        self.fence_checks += 1
        if _lowest(reports, shrink) > level and self.fence_checks < self.policy.fence_checks:
            return None
        split = clamp(self.target, reports, self.cost, self.policy.min_move, self.budget)
        if split is None or tuple(sorted(split.items())) in self.refused:
            top = max(q.total for r in reports for q in r.pools if q.pool == shrink)
            return Move(fence={shrink: top}, lift=True)
        return Move(split=split)

    def applied(self, move: Move, ok: bool, now: float) -> None:
        """The group carried the move out (a split: a new cooldown and sample start), or refused it (a
        refused split is never sent again)."""
        if move.split is not None:
            if ok:
                self.last_time = now
                self.uses.clear()
            else:
                self.refused.add(tuple(sorted(move.split.items())))
            self.fence, self.fence_checks = None, 0
        elif move.fence is not None:
            self.fence = dict(move.fence) if ok and not move.lift else None
            self.fence_checks = 0
            if move.lift:  # the pages never drained: a new cooldown before the next try
                self.last_time = now


def _budget(reports: Sequence[Report], cost: Mapping[str, int]) -> int:
    """Bytes of the smallest rank's pools: one split goes to every rank, so it must fit there."""
    return min(sum(q.total * cost[q.pool] for q in r.pools) for r in reports)


def _shrinking(target: Split, reports: Sequence[Report]) -> str:
    """The pool the target takes pages from."""
    return POOL_FULL if target[POOL_FULL] < current_split(reports)[POOL_FULL] else POOL_SLIDING


def _lowest(reports: Sequence[Report], pool: str) -> int:
    """The smallest size `pool` can shrink to now on every rank: above it, some rank holds a page."""
    return max(q.total - q.movable for r in reports for q in r.pools if q.pool == pool)


def _mean(uses: Sequence[Split], pool: str) -> float:
    return sum(u[pool] for u in uses) / max(1, len(uses))
