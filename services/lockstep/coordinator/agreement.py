"""Prefix-length agreement: how many cached pages every rank may skip, and the book of probe answers.

Each rank's index is its own, so the only prefix every rank can skip is the shortest any of them holds.
Answers arrive per rank and may be delivered twice; the book keeps exactly one answer set per (request,
step), and once the scheduler has consumed a set, nothing can make it wait for that set again (the
re-armed wait of seed 000 that left requests unscheduled forever).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lockstep.kv.paging import first_page
from lockstep.steps import ProbeAnswer


def _check_answer(answer: ProbeAnswer) -> None:
    m, p = answer.matched_pages, answer.pinned_pages
    rid = answer.request_id
    if type(m) is not int or m < 0:
        raise ValueError(f"probe answer for {rid}: matched_pages {m!r} is not an int >= 0")
    if type(p) is not int or not 0 <= p <= m:
        raise ValueError(f"probe answer for {rid}: pinned_pages {p!r} is not in [0, matched {m}]")
    end = 0
    for a, b in answer.sliding_runs:
        if not end <= a < b:
            raise ValueError(f"probe answer for {rid}: sliding_runs {answer.sliding_runs} are not sorted disjoint runs")
        end = b
    if not 0 <= answer.sliding_pinned <= answer.sliding_held:
        raise ValueError(f"probe answer for {rid}: sliding_pinned {answer.sliding_pinned} is not in "
                         f"[0, held {answer.sliding_held}]")


def agreed_prefix_pages(
    answers: Sequence[ProbeAnswer | None], prompt_len: int, page_size: int, window: int = 0
) -> int:
    """The longest prefix every rank can serve (answers[r] is rank r's, None when missing), capped below the
    prompt.

    At least one prompt token is always computed, since its logits give the first sample: a prompt of
    exactly k pages reuses at most k - 1. No answers, or a missing one, agree on 0.

    With a sliding pool (`window` > 0) a rank can serve L pages only if its full pool holds pages 0..L-1
    and its sliding pool the pages of the window before position L * page_size. Those lengths are not
    downward closed (a rank holding full pages 0..9 and sliding pages 8..9 serves 10 but not 6), so the
    minimum of each rank's longest could name a length some rank cannot serve: the largest L that every
    rank serves is searched for, by the pages' identities.
    """
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if type(prompt_len) is not int or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
    if not answers or any(a is None for a in answers):
        return 0
    ids = {a.request_id for a in answers}
    if len(ids) > 1:
        raise ValueError(f"probe answers of different requests mixed: {sorted(ids)}")
    for a in answers:
        _check_answer(a)
    longest = min(min(a.matched_pages for a in answers), (prompt_len - 1) // page_size)
    if window <= 0:
        return longest
    for length in range(longest, 0, -1):
        first = first_page(length * page_size, window, page_size)
        if all(a.sliding_holds(first, length) for a in answers):
            return length
    return 0


def _rank_list(ranks: int | Iterable[int]) -> list[int]:
    if isinstance(ranks, int):
        if ranks < 1:
            raise ValueError(f"a group has at least one rank, got {ranks}")
        return list(range(ranks))
    out = sorted(set(ranks))
    if not out or any(type(r) is not int or r < 0 for r in out):
        raise ValueError(f"ranks must be non-negative ints, got {out!r}")
    return out


class ProbeBook:
    """Probe answers per request, for the one step whose answers the scheduler is waiting for."""

    def __init__(self) -> None:
        self._step: dict[str, int] = {}
        self._answers: dict[str, dict[int, ProbeAnswer]] = {}
        self._consumed: dict[str, int] = {}

    def ask(self, request_id: str, step: int) -> bool:
        """Wait for the answers of plan `step`'s probe; False (nothing changes) if that is not news.

        Asking again for the same step, an older one, or a step whose answers were already consumed is a
        duplicate delivery: it must not reset the answers collected nor re-arm a consumed wait.
        """
        if step <= self._consumed.get(request_id, -1) or step <= self._step.get(request_id, -1):
            return False
        self._step[request_id] = step
        self._answers[request_id] = {}
        return True

    def record(self, step: int, rank: int, answer: ProbeAnswer) -> bool:
        """Keep rank's answer if it is for the step asked; False for stale, unasked or duplicate ones."""
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        _check_answer(answer)
        rid = answer.request_id
        if self._step.get(rid) != step:
            return False
        got = self._answers[rid]
        if rank in got:
            return False
        got[rank] = answer
        return True

    def waiting_on(self, request_id: str) -> int | None:
        """The step whose answers this request waits for, or None."""
        return self._step.get(request_id)

    def missing(self, request_id: str, ranks: int | Iterable[int]) -> list[int]:
        got = self._answers.get(request_id, {})
        return [r for r in _rank_list(ranks) if r not in got]

    def complete(self, request_id: str, ranks: int | Iterable[int]) -> bool:
        """Every rank answered the armed probe (False when none is armed)."""
        return request_id in self._step and not self.missing(request_id, ranks)

    def answers(self, request_id: str, ranks: int | Iterable[int]) -> list[ProbeAnswer | None]:
        """The armed probe's answers in rank order, None where a rank has not answered."""
        got = self._answers.get(request_id, {})
        return [got.get(r) for r in _rank_list(ranks)]

    def consume(self, request_id: str, ranks: int | Iterable[int]) -> list[ProbeAnswer | None]:
        """Take the answers and disarm: no later ask or delivery for this step or before re-arms it."""
        out = self.answers(request_id, ranks)
        step = self._step.pop(request_id, None)
        self._answers.pop(request_id, None)
        if step is not None:
            self._consumed[request_id] = step
        return out

    def forget(self, request_id: str) -> None:
        """Drop everything about a request that left (finished, aborted), so the book stays as small as
        the live set. The scheduler never asks again for an id it has dropped."""
        self._step.pop(request_id, None)
        self._answers.pop(request_id, None)
        self._consumed.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._step.keys() | self._consumed.keys())
