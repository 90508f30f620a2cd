"""A rank's page bookkeeping (`RankCache`) without a model: what each phase of a step does to the pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lockstep.kv.allocator import OutOfPages, PagePool, PrefixNotHeld
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.kv.rank_cache import RankCache, StepRefused
from lockstep.steps import Admit, Chunk, Plan, PoolState, Probe, ProbeAnswer

PS = 4
SALT = key_salt("rank-cache", PS)
PROMPT = tuple(range(1, 15))  # 3 full pages and 2 tokens
KEYS = tuple(page_keys(PROMPT, PS, SALT))


def make(pages: int = 16, caching: bool = True, max_model_len: int = 64) -> RankCache:
    return RankCache(PagePool("full", pages), PS, SALT, max_model_len, caching, rank=3)


def run(cache: RankCache, plan: Plan) -> tuple[tuple[ProbeAnswer, ...], tuple[PoolState, ...]]:
    """One step that nothing refuses: prepare, the chunks 'computed', finish."""
    cache.prepare(plan)
    for chunk in plan.batch:
        cache.advance(chunk)
    out = cache.finish(plan)
    cache.check()
    return out


def refusal(cache: RankCache, plan: Plan) -> StepRefused:
    with pytest.raises(StepRefused) as e:
        cache.prepare(plan)
    cache.undo_admits()
    cache.finish(plan)
    cache.check()
    return e.value


def test_pages_filled_across_chunks_are_committed_under_the_coordinators_keys():
    cache = make()
    run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", PROMPT[:6], 0),)))
    run(cache, Plan(1, batch=(Chunk("a", PROMPT[6:], 6),)))
    (answer,), (state,) = run(cache, Plan(2, probes=(Probe("b", KEYS),)))
    assert answer == ProbeAnswer("b", 3, 3) and state == PoolState("full", 16, 12, 0, 4, pinned=3)
    run(cache, Plan(3, releases=("a",)))
    (answer,), _ = run(cache, Plan(4, admits=(Admit("b", KEYS[:2]),), batch=(Chunk("b", PROMPT[8:], 8),),
                                   probes=(Probe("c", KEYS),)))
    # b pinned two; the third it computed again stays its own (the index keeps the first), a's stays cached.
    assert answer == ProbeAnswer("c", 3, 2)


def test_a_refused_step_undoes_its_admits_and_keeps_what_running_requests_hold():
    cache = make(pages=5)
    run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", (1, 2, 3, 4), 0),)))
    plan = Plan(1, admits=(Admit("b"),), batch=(Chunk("a", (5,), 4), Chunk("b", tuple(range(20)), 0)))
    error = refusal(cache, plan)
    assert isinstance(error.__cause__, OutOfPages) and str(error).startswith("rank 3: pool 'full'")
    assert cache.pool.owners() == ["a"] and len(cache.table("a")) == 2  # a's reserved page stays a's
    run(cache, Plan(2, batch=(Chunk("a", (5,), 4),)))  # its chunk comes again and needs nothing more


def test_admitting_a_request_it_holds_is_refused_and_the_holder_keeps_its_pages():
    cache = make()
    run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", PROMPT, 0),)))
    error = refusal(cache, Plan(1, admits=(Admit("a"),)))
    assert "request a is admitted twice" in str(error)
    _, (state,) = run(cache, Plan(2, batch=(Chunk("a", (9,), len(PROMPT)),)))
    assert state.used == 4


@pytest.mark.parametrize(
    "plan, cause, words",
    [
        (Plan(1, admits=(Admit("b", KEYS),)), PrefixNotHeld, "asked to pin 3 prefix pages"),
        (Plan(1, batch=(Chunk("ghost", (1,), 0),)), StepRefused, "request ghost is not admitted"),
        (Plan(1, batch=(Chunk("a", (1,), 3),)), StepRefused, "chunk starts at 3 but this rank holds 4 tokens"),
        (Plan(1, batch=(Chunk("a", (), 4),)), StepRefused, "request a: empty chunk"),
        (Plan(1, batch=(Chunk("a", (1,) * 61, 4),)), StepRefused, "position 65 is past the model's context"),
        (Plan(1, admits=(Admit(["x"]),)), TypeError, "TypeError while preparing the step"),  # type: ignore[arg-type]
    ],
)
def test_refusals_name_the_rank_and_keep_their_cause(plan, cause, words):
    cache = make()
    run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", (1, 2, 3, 4), 0),)))
    error = refusal(cache, plan)
    assert type(error.__cause__) is cause and words in str(error) and str(error).startswith("rank 3: ")
    assert cache.pool.owners() == ["a"]


@pytest.mark.parametrize(
    "chunk, words",
    [
        (Chunk("ghost", (1,), 5), "request ghost is not admitted"),
        (Chunk("a", (1,), 6), "chunk starts at 6 but this rank holds 5 tokens"),
        (Chunk("a", (), 5), "request a: empty chunk"),
        (Chunk("a", (1, 2), 5), "position 7 is past the model's context"),
    ],
)
def test_a_chunk_inside_a_page_it_holds_is_checked_as_any_other(chunk, words):
    """Most decode chunks go into a page the request holds already, and skip the allocation; not the checks."""
    cache = make(max_model_len=6)
    run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", (1, 2, 3, 4, 5), 0),)))
    error = refusal(cache, Plan(1, batch=(chunk,)))
    assert words in str(error) and cache.pool.owners() == ["a"] and len(cache.table("a")) == 2
    run(cache, Plan(2, batch=(Chunk("a", (6,), 5),)))


def test_the_flush_comes_after_the_pins_and_the_probes_after_the_flush():
    cache = make()
    run(cache, Plan(0, admits=(Admit("w"),), batch=(Chunk("w", PROMPT[:12], 0),)))
    run(cache, Plan(1, releases=("w",)))
    plan = Plan(2, admits=(Admit("x", KEYS[:1]),), batch=(Chunk("x", PROMPT[4:6], 4),),
                probes=(Probe("y", KEYS),), flush_prefix_cache=True)
    (answer,), (state,) = run(cache, plan)
    assert answer == ProbeAnswer("y", 1, 1) and state == PoolState("full", 16, 14, 0, 2, pinned=1)


def test_release_all_drops_every_request():
    cache = make()
    run(cache, Plan(0, admits=(Admit("a"), Admit("b")), batch=(Chunk("a", (1,), 0), Chunk("b", PROMPT, 0))))
    _, (state,) = run(cache, Plan(1, release_all=True))
    assert cache.pool.owners() == [] and state.used == 0 and state.evictable == 3


def test_prefix_caching_off_commits_nothing_and_refuses_a_prefix():
    cache = make(caching=False)
    (answer,), (state,) = run(cache, Plan(0, admits=(Admit("a"),), batch=(Chunk("a", PROMPT, 0),),
                                          probes=(Probe("b", KEYS),)))
    assert answer == ProbeAnswer("b", 0, 0) and state.pinned == 0 and state.used == 4
    assert "prefix caching is off on rank 3" in str(refusal(cache, Plan(1, admits=(Admit("b", KEYS[:1]),))))


def test_kv_imports_no_torch_grpc_or_aiohttp():
    code = ("import sys, lockstep.kv.rank_cache, lockstep.kv.paging; "
            "bad = [m for m in ('torch', 'grpc', 'aiohttp') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_abstaining_plan_is_refused_and_changes_nothing():
    cache = make()
    run(cache, Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", PROMPT, 0),)))
    before = cache.stats()
    exc = refusal(cache, Plan(step=1, releases=("a",), abstain=True))
    assert "rank 3 abstains from step 1" in str(exc)
    assert cache.stats() == before and cache.table("a")  # not even its releases were carried out


def test_the_block_table_follows_every_requests_pages_and_reuses_rows_blank():
    """The forward reads pages off `block_tables` (one row per request), not off the tables: every admit,
    allocation and release must show there (`check` compares the two), a row must grow past its first columns
    and the table past its first rows, and a released row handed out again must hold none of its old pages."""
    cache = make(pages=400, max_model_len=4096)
    ids = [f"r{i}" for i in range(40)]  # more than the table's first 16 rows
    run(cache, Plan(0, admits=tuple(Admit(r) for r in ids), batch=tuple(Chunk(r, (1, 2, 3), 0) for r in ids)))
    long = tuple(range(3, 300))  # 75 pages: past the table's first 64 columns
    run(cache, Plan(1, batch=(Chunk("r0", long, 3),)))
    table = cache.block_tables["full"]
    assert table.rows >= 40 and table.cols >= 75
    assert table.row(cache.row("r0"), 75) == cache.table("r0")
    row = cache.row("r0")
    run(cache, Plan(2, releases=("r0",), admits=(Admit("new"),), batch=(Chunk("new", (9,), 0),)))
    assert cache.row("new") == row  # the freed row comes back first
    assert table.row(row, 75) == cache.table("new") + [-1] * 74
    refusal(cache, Plan(3, admits=(Admit("x"), Admit("x")), batch=()))
    assert len({cache.row(r) for r in [*ids[1:], "new"]}) == 40


def test_a_block_table_grows_without_losing_a_row_and_refuses_a_row_it_lacks():
    from lockstep.kv.block_table import BlockTable

    table = BlockTable(rows=2, cols=3)
    table.write(1, 0, [7, 8, 9])
    before = table.data
    table.write(1, 3, [10])  # a fourth column: a new array, row 1 kept
    table.grow(5)
    assert table.data is not before and table.rows >= 5
    assert table.row(1, 5) == [7, 8, 9, 10, -1] and table.row(0, 2) == [-1, -1]
    table.clear(1, 1, 2)
    assert table.row(1, 4) == [7, -1, -1, 10]
    assert [table.page(1, c) for c in (0, 1, 3, table.cols, -1)] == [7, -1, 10, -1, -1]  # one page, as `row` reads
    with pytest.raises(IndexError, match="cannot write"):
        table.write(table.rows, 0, [1])


def test_a_running_requests_growth_never_evicts_the_prefix_an_admit_of_the_same_plan_pins():
    """Seed 000's eviction between probe and use, inside one plan: the agreed prefix is the oldest evictable run
    and no page is free, so only pinning before any allocation keeps a running request's growth (first in the
    batch) from evicting the pages the new request was told to skip. (A review's pin: with the allocations
    first, only one seed of the long random runs noticed.)"""
    cache = RankCache(PagePool("full", 6), PS, SALT, 64, True)
    a, e, b = tuple(range(1, 9)), tuple(range(20, 28)), tuple(range(40, 48))

    def run(plan: Plan) -> None:
        cache.prepare(plan)
        for c in plan.batch:
            cache.advance(c)
        cache.finish(plan)
        cache.check()

    run(Plan(0, admits=(Admit("a"), Admit("e"), Admit("b")),
             batch=(Chunk("a", a, 0), Chunk("e", e, 0), Chunk("b", b, 0))))
    run(Plan(1, releases=("a",)))  # a's pages 0, 1: evictable, least recently used
    run(Plan(2, releases=("e",)))  # e's pages 2, 3: evictable, newer
    assert cache.pool.stats().free == 0
    keys = tuple(page_keys(a, PS, SALT))
    answer = cache.probe("c", keys)
    assert (answer.matched_pages, answer.pinned_pages) == (2, 0)
    run(Plan(3, admits=(Admit("c", keys),), batch=(Chunk("b", (48,), 8), Chunk("c", (9,), 8))))
    assert cache.table("c")[:2] == [0, 1]
