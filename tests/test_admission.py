"""Admission control across ranks that differ: the decision follows the worst rank, counted conservatively."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.coordinator.admission import (
    DEFERRAL_REASONS,
    AdmissionControl,
    Decision,
    allocatable_pages,
    fits,
    growth_pages,
    pages_for,
    pin_takeout,
)
from lockstep.steps import PoolState, ProbeAnswer, Report

PS = 4


def rep(rank: int, total: int, free: int, evictable: int = 0, step: int = 0) -> Report:
    pool = PoolState("full", total, free, evictable, total - free - evictable)
    return Report(step=step, rank=rank, pools=(pool,))


def control(*reports: Report, seqs: int = 8, tokens: int = 64, running: int = 0) -> AdmissionControl:
    return AdmissionControl(list(reports), PS, seqs, tokens, running)


def test_page_arithmetic():
    assert [pages_for(n, PS) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert growth_pages(3, 1, PS) == 0  # position 3 is still page 0
    assert growth_pages(4, 1, PS) == 1
    assert growth_pages(8, 9, PS) == 3
    assert growth_pages(0, 0, PS) == 0


def test_allocatable_is_free_plus_evictable_of_the_tightest_pool():
    r = Report(step=0, rank=0, pools=(PoolState("full", 20, 3, 5, 12), PoolState("swa", 10, 1, 2, 7)))
    assert allocatable_pages(r) == 3
    with pytest.raises(ValueError, match="rank 0 for step 0 has no pool states"):
        allocatable_pages(Report(step=0, rank=0))


def test_pin_takeout_counts_pinned_pages_only_when_they_must_be_ours():
    assert pin_takeout(ProbeAnswer("r", 5, 0), 3) == 3  # all three are evictable now
    assert pin_takeout(ProbeAnswer("r", 3, 3), 3) == 0  # all three already pinned by live requests
    assert pin_takeout(ProbeAnswer("r", 5, 2), 3) == 3  # the two pinned may be pages 4 and 5
    assert pin_takeout(ProbeAnswer("r", 5, 4), 3) == 1  # at least 2 of the first 3 are pinned
    assert pin_takeout(ProbeAnswer("r", 5, 4), 0) == 0
    assert pin_takeout(None, 2) == 2


def test_a_flushed_rank_decides_for_the_group():
    prompt = 30
    offers = [ProbeAnswer("r", 7, 0), ProbeAnswer("r", 0, 0)]  # rank 1 was flushed: nothing cached
    agreed = 0
    c = control(rep(0, 40, 2, 30), rep(1, 40, 8, 0))
    d = c.consider(prompt, agreed, offers)
    assert d.admit and d.pages == (8, 8)  # the whole prompt is computed on both ranks
    c2 = control(rep(0, 40, 2, 30), rep(1, 40, 8, 0))
    d2 = c2.consider(prompt + 4, agreed, offers)  # 9 pages: rank 1 has 8
    assert not d2.admit and d2.reason == "pages" and d2.rank == 1
    assert c2.headroom == [32, 8]  # a deferral takes nothing


def test_a_smaller_pool_defers_even_when_the_others_have_room():
    c = control(rep(0, 100, 100), rep(1, 100, 100), rep(2, 6, 6))
    assert not c.consider(25, 0).admit  # 7 pages
    d = c.consider(24, 0)
    assert d.admit and c.headroom == [94, 94, 0]


def test_pinning_takes_cached_pages_out_of_each_ranks_evictable_set():
    # 3 agreed pages: evictable on rank 0, already pinned by a live request on rank 1
    offers = [ProbeAnswer("r", 3, 0), ProbeAnswer("r", 3, 3)]
    c = control(rep(0, 20, 1, 4), rep(1, 20, 2, 0))
    d = c.consider(13, 3, offers)  # first chunk: position 12, one new page
    assert d.admit and d.pages == (4, 1)
    assert c.headroom == [1, 1]


def test_two_requests_with_the_same_prefix_are_counted_twice():
    offers = [ProbeAnswer("a", 4, 0)]
    c = control(rep(0, 20, 2, 7))
    first = c.consider(18, 4, offers)
    assert first.admit and first.pages == (5,)  # 4 cached + 1 new
    second = c.consider(18, 4, [ProbeAnswer("b", 4, 0)])
    assert not second.admit and second.reason == "pages"  # the real need is 1, but 5 are charged
    assert c.headroom == [4]


def test_running_growth_comes_first_and_shrinks_what_admission_sees():
    c = control(rep(0, 10, 3), rep(1, 10, 2))
    assert c.grow(num_computed=8, num_tokens=1) == 1  # decode at position 8 opens page 2
    assert c.headroom == [2, 1]
    assert c.grow(num_computed=9, num_tokens=1) == 1  # position 9 fits in page 2
    assert c.headroom == [2, 1]
    assert not c.consider(5, 0).admit  # 2 pages, rank 1 has 1 left


def test_grow_cuts_a_prefill_chunk_to_the_pages_every_rank_has():
    c = control(rep(0, 10, 5), rep(1, 10, 2))
    assert c.grow(num_computed=6, num_tokens=40) == 10  # it holds pages 0-1; 2 more reach position 15
    assert c.headroom == [3, 0]
    assert c.grow(num_computed=16, num_tokens=3) == 0
    assert c.shortfall(16, 3) == {"full": 1}
    assert c.grow(num_computed=17, num_tokens=3) == 3  # inside a page it holds: no new page


def test_grow_respects_the_token_budget():
    c = control(rep(0, 100, 100), tokens=5)
    assert c.grow(0, 3) == 3
    assert c.grow(3, 10) == 2
    assert c.grow(5, 1) == 0 and c.tokens_left == 0


@pytest.mark.parametrize("charged", [0, 3])
def test_grow_in_page_takes_a_decode_exactly_as_grow_does_or_leaves_it_to_grow(charged):
    """The plan-ahead fast path (`grow_in_page`) must never take what `grow(c, 1)` would not, nor count it
    differently: over positions, budgets and an overdrawn pool, it either does what grow does or nothing."""
    for tokens in (0, 1, 2):
        for free in (0, 1):
            for c_at in range(0, 3 * PS + 1):
                fast, slow = control(rep(0, 10, free), tokens=tokens), control(rep(0, 10, free), tokens=tokens)
                for ctl in (fast, slow):
                    ctl.charge({"full": [charged]})
                took = fast.grow_in_page(c_at)
                if took:
                    assert slow.grow(c_at, 1) == 1
                else:
                    assert (fast.tokens_left, fast.headroom) == (tokens, [free - charged])
                    slow.grow(c_at, 1)
                    fast.grow(c_at, 1)
                assert (fast.tokens_left, fast.headroom) == (slow.tokens_left, slow.headroom)
                assert took == (tokens > 0 and c_at % PS != 0 and free >= charged)


def _grow_by_pages(c: AdmissionControl, num_computed: int, num_tokens: int) -> int:
    """`AdmissionControl.grow` stated plainly: every chunk that may take a page counts the pages per rank."""
    n = min(num_tokens, c.tokens_left, c.chunk_tokens)
    if n <= 0:
        return 0
    if pages_for(num_computed + n, PS) == pages_for(num_computed, PS) and not any(
            h < 0 for room in c.room.values() for h in room):
        c.tokens_left -= n
        return n
    n = min(n, (pages_for(num_computed, PS) + min(c.headroom)) * PS - num_computed)
    if n <= 0:
        return 0
    c.take([growth_pages(num_computed, n, PS)] * c.ranks, n)
    return n


@settings(max_examples=300, deadline=None)
@given(rooms=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=3),
       charged=st.tuples(st.integers(0, 4), st.integers(0, 4)), tokens=st.integers(0, 3),
       grows=st.lists(st.tuples(st.integers(0, 4 * PS), st.integers(1, 2 * PS)), min_size=1, max_size=8))
def test_grow_takes_what_counting_pages_per_rank_takes(rooms, charged, tokens, grows):
    """grow's shortcuts (a chunk within held pages; a decode into a new page, one page everywhere) take exactly
    what counting pages per rank and pool takes, over ranks and pools that differ, overdrawn ones included."""
    def build() -> AdmissionControl:
        reports = [Report(step=0, rank=r, pools=(PoolState("full", 10, full, 0, 10 - full),
                                                 PoolState("sliding", 10, sliding, 0, 10 - sliding)))
                   for r, (full, sliding) in enumerate(rooms)]
        c = AdmissionControl(reports, PS, 8, tokens, 0)
        c.charge({"full": [charged[0]] * len(rooms), "sliding": [charged[1]] * len(rooms)})
        return c

    fast, plain = build(), build()
    for num_computed, num_tokens in grows:
        assert fast.grow(num_computed, num_tokens) == _grow_by_pages(plain, num_computed, num_tokens)
        assert (fast.room, fast.tokens_left, fast.spent()) == (plain.room, plain.tokens_left, plain.spent())


@pytest.mark.parametrize(
    ("kwargs", "call", "reason"),
    [
        ({"seqs": 2, "running": 2}, {}, "max_num_seqs"),
        ({"tokens": 0}, {}, "token_budget"),
        ({}, {"probe_ready": False}, "probe_pending"),
        ({"tokens": 400}, {"num_tokens": 400}, "pages"),
    ],
)
def test_each_deferral_reason(kwargs, call, reason):
    c = control(rep(0, 50, 50), **kwargs)
    d = c.consider(**{"num_tokens": 10, "agreed": 0, **call})
    assert not d.admit and d.reason == reason and reason in DEFERRAL_REASONS


def test_admission_takes_sequences_and_tokens():
    c = control(rep(0, 50, 50), seqs=2, tokens=10)
    d = c.consider(7, 0)
    assert d.admit and d.num_tokens == 7 and c.tokens_left == 3 and c.seqs_left == 1
    d = c.consider(20, 0)
    assert d.admit and d.num_tokens == 3  # chunked: the rest comes next steps
    assert c.consider(5, 0).reason == "max_num_seqs"


def test_first_chunk_starts_after_the_agreed_prefix():
    c = control(rep(0, 50, 50))
    d = c.consider(20, 2, [ProbeAnswer("r", 2, 2)])
    assert d.num_tokens == 12 and d.pages == (3,)
    with pytest.raises(ValueError, match="must leave a token"):
        c.consider(8, 2, [ProbeAnswer("r", 2, 0)])


def test_take_spends_headroom_and_overdraw_is_refused():
    c = control(rep(0, 10, 4), rep(1, 10, 4))
    c.take([3, 1], num_tokens=5)
    assert c.headroom == [1, 3] and c.tokens_left == 59
    with pytest.raises(ValueError, match="overdraws"):
        c.take([5, 0])


def test_fits_and_bad_inputs():
    assert fits([1, 2], [1, 2]) and not fits([1, 3], [1, 2])
    with pytest.raises(ValueError, match="2 ranks against headroom of 1"):
        fits([1, 1], [3])
    with pytest.raises(ValueError, match="rank order"):
        control(rep(1, 10, 10), rep(0, 10, 10))
    with pytest.raises(ValueError, match="needs the last report"):
        AdmissionControl([], PS, 1, 1, 0)
    with pytest.raises(ValueError, match="needs a reason"):
        Decision(False, "because")


def test_largest_request_is_bounded_by_the_smallest_pool():
    c = control(rep(0, 50, 1), rep(1, 9, 9))
    assert c.too_large(9 * PS) == ""
    assert "needs up to 10 KV pages of pool 'full' but the smallest rank pool holds 9" in c.too_large(9 * PS + 1)
