"""Hybrid models keep one KV pool per attention kind: `full` holds a request's whole context, `sliding` only
the pages its window still reads. These tests drive the real bookkeeping (`PagePool`, `RankCache`), the
prefix agreement and admission control without a model; the engine's side is in test_hybrid_engine.py."""

from __future__ import annotations

import pytest

from lockstep.coordinator.admission import AdmissionControl
from lockstep.coordinator.agreement import agreed_prefix_pages
from lockstep.kv.allocator import PagePool
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.kv.paging import first_page, held_pages, pages_for, peak_pages
from lockstep.kv.rank_cache import RankCache, StepRefused
from lockstep.steps import Admit, Chunk, Plan, PoolState, Probe, ProbeAnswer, Report

PS = 4
WINDOW = 8  # a query at p sees keys (p - 8, p]: two pages and the page being written
SALT = key_salt("hybrid", PS)
PROMPT = tuple(range(1, 42))  # 10 full pages and one token
KEYS = tuple(page_keys(PROMPT, PS, SALT))


def make(full: int = 32, sliding: int = 8, caching: bool = True) -> RankCache:
    pools = {"full": PagePool("full", full), "sliding": PagePool("sliding", sliding)}
    return RankCache(pools, PS, SALT, 1 << 20, caching, rank=1, window=WINDOW)


def run(cache: RankCache, plan: Plan) -> tuple[tuple[ProbeAnswer, ...], dict[str, PoolState]]:
    cache.prepare(plan)
    for chunk in plan.batch:
        cache.advance(chunk)
    probes, pools = cache.finish(plan)
    cache.check()
    return probes, {p.pool: p for p in pools}


def test_page_arithmetic_of_a_window():
    assert first_page(0, WINDOW, PS) == 0 and first_page(8, WINDOW, PS) == 0  # 8 sees 1..8: page 0 still
    assert first_page(11, WINDOW, PS) == 1 and first_page(12, WINDOW, PS) == 1 and first_page(13, WINDOW, PS) == 1
    assert first_page(15, WINDOW, PS) == 2 and first_page(40, None, PS) == 0
    assert held_pages(40, WINDOW, PS) == 10 - first_page(40, WINDOW, PS) == 2
    assert peak_pages(WINDOW, PS, 1000) == 3 and peak_pages(None, PS, 1000) == 250 and peak_pages(WINDOW, PS, 5) == 2


def test_holding_finds_pages_past_a_gap_and_drop_front_keeps_cached_pages():
    pool = PagePool("sliding", 6)
    pool.allocate("a", 4)
    for i, page in enumerate(pool.table("a")):
        pool.commit("a", page, KEYS[i])
    pool.drop_front("a", 2)
    assert pool.table("a") == [2, 3] and pool.stats().evictable == 2
    assert pool.holding(KEYS[:6]) == (((0, 4),), 2)
    pool.evict(1)  # the least recently used: page 0, the first the window left
    assert pool.holding(KEYS[:6]) == (((1, 4),), 2)
    pool.release("a")
    pool.check()
    with pytest.raises(ValueError, match="cannot drop"):
        pool.allocate("b", 1) and pool.drop_front("b", 2)


def test_a_long_request_holds_its_whole_context_in_full_and_a_window_in_sliding():
    cache = make(full=32, sliding=4)
    _, pools = run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", PROMPT[:8], 0),)))
    assert pools["full"].used == 2 and pools["sliding"].used == 2
    for step, start in enumerate(range(8, 41), start=1):
        _, pools = run(cache, Plan(step, batch=(Chunk("a", PROMPT[start:start + 1], start),)))
        length = start + 1
        assert pools["full"].used == pages_for(length, PS)
        assert pools["sliding"].used == held_pages(length, WINDOW, PS) <= 3
    table = cache.table("a", "sliding")
    assert table[:first_page(41, WINDOW, PS)] == [-1] * first_page(41, WINDOW, PS)
    # the pages the window left were committed first: they stay cached (evictable), not lost
    assert pools["sliding"].evictable == 4 - pools["sliding"].used
    run(cache, Plan(99, releases=("a",)))
    for pool in cache.pools.values():
        s = pool.stats()
        assert s.used == 0 and s.pinned == 0 and s.free + s.evictable == s.total


def _fill_and_release(cache: RankCache, tokens: tuple[int, ...]) -> None:
    """Compute `tokens` in chunks of 8, as admission control would cut them for an 8-page sliding pool."""
    run(cache, Plan(0, admits=(Admit("w"),), batch=(Chunk("w", tokens[:8], 0),)))
    for start in range(8, len(tokens), 8):
        run(cache, Plan(0, batch=(Chunk("w", tokens[start:start + 8], start),)))
    run(cache, Plan(1, releases=("w",)))


def test_probe_answers_name_the_pages_each_pool_holds():
    cache = make(full=32, sliding=8)
    _fill_and_release(cache, PROMPT[:40])  # 10 pages; the sliding pool kept them all (8 pages, LRU)
    (answer,), _ = run(cache, Plan(2, probes=(Probe("b", KEYS),)))
    assert answer.matched_pages == 10
    assert answer.sliding_runs == ((2, 10),)  # the two oldest were evicted for the last two
    assert answer.sliding_holds(8, 10) and not answer.sliding_holds(1, 3)


def test_the_minimum_of_longest_matches_can_name_a_length_a_rank_cannot_serve():
    """The counterexample of docs/architecture.md: full pages 0..9 on both ranks, sliding pages 8..9 on one
    of them. Both serve 10, and 10 is what is agreed; cut the prompt so that at most 6 can be used and the
    one-pool rule would say 6, which rank 0 cannot serve (it lacks sliding pages 4..5): agreed is smaller."""
    rank0 = ProbeAnswer("r", 10, 0, ((8, 10),), 0)
    rank1 = ProbeAnswer("r", 10, 0, ((0, 10),), 0)
    assert agreed_prefix_pages([rank0, rank1], 41, PS, WINDOW) == 10
    assert agreed_prefix_pages([rank0, rank1], 25, PS) == 6  # the one-pool rule
    assert agreed_prefix_pages([rank0, rank1], 25, PS, WINDOW) == 0  # nothing below 10 is servable on rank 0
    gap = ProbeAnswer("r", 10, 0, ((0, 2), (4, 6), (8, 10)), 0)  # serves 2, 6 and 10 only
    assert agreed_prefix_pages([gap, rank1], 41, PS, WINDOW) == 10
    assert agreed_prefix_pages([gap, rank1], 33, PS, WINDOW) == 6
    assert agreed_prefix_pages([gap, rank1], 24, PS, WINDOW) == 2
    with pytest.raises(ValueError, match="sorted disjoint"):
        agreed_prefix_pages([ProbeAnswer("r", 3, 0, ((2, 3), (0, 1)), 0)], 41, PS, WINDOW)


def test_a_rank_told_to_pin_a_window_it_does_not_hold_refuses_and_leaks_nothing():
    cache = make(full=32, sliding=8)
    _fill_and_release(cache, PROMPT[:40])
    keys = KEYS[:4]  # pinning 4 pages needs sliding pages 2..3, which it holds; 2 needs 0..1, evicted
    run(cache, Plan(2, admits=(Admit("ok", keys),), batch=(Chunk("ok", PROMPT[16:20], 16),)))
    with pytest.raises(StepRefused, match="sliding"):
        cache.prepare(Plan(3, admits=(Admit("bad", KEYS[:2]),), batch=(Chunk("bad", PROMPT[8:9], 8),)))
    cache.undo_admits()
    cache.finish(Plan(3))
    cache.check()
    assert cache.pools["full"].owners() == ["ok"] and cache.pools["sliding"].owners() == ["ok"]


def _report(rank: int, full: tuple[int, int], sliding: tuple[int, int]) -> Report:
    pools = (PoolState("full", full[0], full[1], 0, full[0] - full[1]),
             PoolState("sliding", sliding[0], sliding[1], 0, sliding[0] - sliding[1]))
    return Report(step=0, rank=rank, pools=pools)


def test_admission_counts_each_pool_on_every_rank():
    control = AdmissionControl([_report(0, (100, 100), (10, 2)), _report(1, (100, 100), (10, 10))], PS, 8, 64, 0,
                               window=WINDOW)
    assert not control.consider(12, 0).admit  # 3 pages in both pools; rank 0's sliding pool has 2
    assert control.consider(8, 0).admit
    assert control.room == {"full": [98, 98], "sliding": [0, 8]}
    assert control.too_large(300) == ""  # the sliding pool needs only a window
    assert "pool 'sliding'" in AdmissionControl([_report(0, (100, 100), (2, 2))], PS, 8, 64, 0,
                                                window=WINDOW).too_large(100)


def test_a_long_prompt_is_admitted_in_a_chunk_its_window_pool_can_hold():
    control = AdmissionControl([_report(0, (100, 100), (4, 4))], PS, 8, 64, 0, window=WINDOW)
    decision = control.consider(40, 0)
    assert decision.admit and decision.num_tokens == 16  # 4 sliding pages, not the 10 of a whole prompt
    assert control.held(40) == {"full": 10, "sliding": 2}


def test_a_fence_left_by_an_earlier_coordinator_is_lifted_by_release_all():
    """A fence is the rebalance decision of one coordinator's Rebalancer; a group that comes back (a new scheduler
    and Rebalancer, fence unknown) first sends release_all, which must lift it too. Otherwise the pages above it
    were never handed out again, with no rebalance coming to lift it (the split already matched the target)."""
    cache = make(full=32, sliding=8)
    run(cache, Plan(1, pool_fence=(("full", 12),)))
    _, pools = run(cache, Plan(2))
    assert pools["full"].fenced == 20 and cache.pools["full"].fence == 12
    _, pools = run(cache, Plan(3, release_all=True))
    assert pools["full"].fenced == 0 and pools["full"].free == 32 and cache.pools["full"].fence == 32
