"""Prefix-length agreement (min over ranks, capped below the prompt) and the probe book's idempotency."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockstep.coordinator.agreement import ProbeBook, agreed_prefix_pages
from lockstep.steps import ProbeAnswer


def answers(*matched: int, rid: str = "r") -> list[ProbeAnswer]:
    return [ProbeAnswer(rid, m, 0) for m in matched]


def test_agreed_is_the_smallest_offer():
    assert agreed_prefix_pages(answers(6, 4, 5), prompt_len=100, page_size=4) == 4
    assert agreed_prefix_pages(answers(0, 9), prompt_len=100, page_size=4) == 0


@pytest.mark.parametrize(
    ("prompt_len", "page_size", "cap"),
    [(1, 4, 0), (4, 4, 0), (5, 4, 1), (8, 4, 1), (9, 4, 2), (16, 16, 0), (17, 16, 1), (3, 1, 2)],
)
def test_at_least_one_prompt_token_is_always_computed(prompt_len, page_size, cap):
    assert agreed_prefix_pages(answers(50, 50), prompt_len, page_size) == cap


def test_a_prompt_of_exactly_k_pages_reuses_k_minus_one():
    for k in range(1, 6):
        assert agreed_prefix_pages(answers(k, k), prompt_len=4 * k, page_size=4) == k - 1


def test_a_missing_rank_or_no_answers_agree_on_zero():
    full = ProbeAnswer("r", 3, 1)
    assert agreed_prefix_pages([full, None], 100, 4) == 0
    assert agreed_prefix_pages([None], 100, 4) == 0
    assert agreed_prefix_pages([], 100, 4) == 0


@given(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(1, 200), st.integers(1, 16))
def test_agreement_never_exceeds_any_rank_nor_the_prompt(matched, prompt_len, page_size):
    agreed = agreed_prefix_pages(answers(*matched), prompt_len, page_size)
    assert 0 <= agreed <= min(matched)
    assert agreed * page_size < prompt_len
    assert agreed == min(min(matched), (prompt_len - 1) // page_size)


def test_bad_answers_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="matched_pages -1"):
        agreed_prefix_pages([ProbeAnswer("r", -1, 0)], 10, 4)
    with pytest.raises(ValueError, match=r"pinned_pages 3 is not in \[0, matched 2\]"):
        agreed_prefix_pages([ProbeAnswer("r", 2, 3)], 10, 4)
    with pytest.raises(ValueError, match="different requests"):
        agreed_prefix_pages([ProbeAnswer("a", 1, 0), ProbeAnswer("b", 1, 0)], 10, 4)
    with pytest.raises(ValueError, match="page_size"):
        agreed_prefix_pages(answers(1), 10, 0)
    with pytest.raises(ValueError, match="prompt_len"):
        agreed_prefix_pages(answers(1), 0, 4)


def test_book_completes_when_every_rank_answered_the_step_asked():
    book = ProbeBook()
    assert book.ask("r", 3)
    assert not book.complete("r", 2)
    assert book.record(3, 0, ProbeAnswer("r", 4, 1))
    assert book.missing("r", 2) == [1]
    assert book.answers("r", 2) == [ProbeAnswer("r", 4, 1), None]
    assert book.record(3, 1, ProbeAnswer("r", 2, 0))
    assert book.complete("r", 2) and book.complete("r", [0, 1])
    assert not book.complete("r", 3)
    assert book.waiting_on("r") == 3


def test_book_ignores_duplicates_other_steps_and_unasked_requests():
    book = ProbeBook()
    book.ask("r", 5)
    assert book.record(5, 0, ProbeAnswer("r", 4, 0))
    assert not book.record(5, 0, ProbeAnswer("r", 1, 0))  # a duplicate delivery does not overwrite
    assert not book.record(4, 1, ProbeAnswer("r", 9, 0))  # an older step's answer
    assert not book.record(6, 1, ProbeAnswer("r", 9, 0))  # a step not asked
    assert not book.record(5, 1, ProbeAnswer("other", 9, 0))
    assert book.answers("r", 2) == [ProbeAnswer("r", 4, 0), None]
    assert not book.ask("r", 5) and not book.ask("r", 4)  # re-asking keeps what was collected
    assert book.answers("r", 1) == [ProbeAnswer("r", 4, 0)]


def test_consumed_answers_are_never_waited_for_again():
    """Seed 000: a second delivery of the same request re-armed a wait nobody would answer."""
    book = ProbeBook()
    book.ask("r", 7)
    book.record(7, 0, ProbeAnswer("r", 3, 0))
    book.record(7, 1, ProbeAnswer("r", 2, 0))
    taken = book.consume("r", 2)
    assert agreed_prefix_pages(taken, 100, 4) == 2
    assert not book.ask("r", 7)  # the duplicate ask of the consumed step
    assert book.waiting_on("r") is None and not book.complete("r", 2)
    assert not book.record(7, 0, ProbeAnswer("r", 3, 0))  # a late duplicate of a consumed answer
    assert book.waiting_on("r") is None
    assert book.ask("r", 9)  # a new probe of a later step (after a preemption) is news
    assert book.missing("r", 2) == [0, 1]


def test_re_asking_a_later_step_drops_the_stale_answers():
    book = ProbeBook()
    book.ask("r", 1)
    book.record(1, 0, ProbeAnswer("r", 5, 0))
    assert book.ask("r", 2)
    assert book.answers("r", 1) == [None]
    assert not book.record(1, 0, ProbeAnswer("r", 5, 0))
    assert book.record(2, 0, ProbeAnswer("r", 1, 0))


def test_forget_keeps_the_book_as_small_as_the_live_set():
    book = ProbeBook()
    for i in range(50):
        book.ask(f"r{i}", i)
        book.consume(f"r{i}", 1)
    assert len(book) == 50
    for i in range(50):
        book.forget(f"r{i}")
    assert len(book) == 0
    assert not book.record(3, 0, ProbeAnswer("r3", 1, 0))


def test_book_rejects_bad_ranks():
    book = ProbeBook()
    book.ask("r", 0)
    with pytest.raises(ValueError, match="rank must be"):
        book.record(0, -1, ProbeAnswer("r", 1, 0))
    with pytest.raises(ValueError, match="at least one rank"):
        book.complete("r", 0)
