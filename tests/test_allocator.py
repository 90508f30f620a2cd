"""The page allocator and prefix index of one pool: each method, each error, each awkward case."""

from __future__ import annotations

import pytest

from lockstep.kv.allocator import OutOfPages, PagePool, PrefixNotHeld
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.kv.paging import pages_for
from lockstep.kv.prefix_index import PrefixIndex
from lockstep.steps import PoolState

PS = 2
SALT = key_salt("test-model", PS)


def keys_of(tokens: list[int]) -> list[bytes]:
    return page_keys(tokens, PS, SALT)


def cached(pool: PagePool, owner: str, tokens: list[int]) -> list[int]:
    """Run one request to completion: allocate its pages, commit every full one, release it."""
    keys = keys_of(tokens)
    pages = pool.allocate(owner, pages_for(len(tokens), PS))
    for page, key in zip(pages, keys, strict=False):
        assert pool.commit(owner, page, key)
    pool.release(owner)
    pool.check()
    return pages


def state(pool: PagePool) -> tuple:
    return pool.stats(), {o: pool.table(o) for o in pool.owners()}


def test_fresh_pool_is_all_free() -> None:
    pool = PagePool("full", 5)
    assert pool.stats() == PoolState(pool="full", total=5, free=5, evictable=0, used=0, pinned=0)
    assert pool.stats().movable == 5
    assert pool.owners() == []
    pool.check()


def test_allocate_appends_distinct_pages_in_position_order() -> None:
    pool = PagePool("full", 6)
    first = pool.allocate("a", 2)
    second = pool.allocate("a", 3)
    assert pool.table("a") == first + second
    assert len(set(first + second)) == 5
    assert pool.allocate("a", 0) == []
    assert pool.stats() == PoolState("full", 6, free=1, evictable=0, used=5, pinned=0)
    pool.check()


def test_out_of_pages_names_the_counts_and_changes_nothing() -> None:
    pool = PagePool("full", 6)
    cached(pool, "a", [1, 2, 3, 4])
    pool.allocate("b", 2)
    before = state(pool)
    with pytest.raises(OutOfPages, match=r"'c' asked for 5 pages but only 2 free \+ 2 evictable = 4") as err:
        pool.allocate("c", 5)
    assert (err.value.asked, err.value.free, err.value.evictable) == (5, 2, 2)
    assert state(pool) == before
    assert "c" not in pool.owners()
    assert pool.probe(keys_of([1, 2, 3, 4])) == (2, 0)
    pool.check()


def test_allocate_uses_free_pages_before_evicting() -> None:
    pool = PagePool("full", 4)
    cached(pool, "a", [1, 2, 3, 4])
    pool.allocate("b", 2)
    assert pool.probe(keys_of([1, 2, 3, 4])) == (2, 0)
    assert pool.stats().evictable == 2


def test_allocate_evicts_least_recently_released_first() -> None:
    pool = PagePool("full", 4)
    old = cached(pool, "old", [1, 1])
    new = cached(pool, "new", [2, 2])
    pool.allocate("x", 2)
    got = pool.allocate("y", 1)
    assert got == old
    assert pool.probe(keys_of([1, 1])) == (0, 0)
    assert pool.probe(keys_of([2, 2])) == (1, 0)
    assert new[0] not in pool.table("x") + pool.table("y")
    pool.check()


def test_a_released_chain_loses_its_tail_before_its_head() -> None:
    pool = PagePool("full", 3)
    tokens = [1, 2, 3, 4, 5, 6]
    cached(pool, "a", tokens)
    assert pool.evict(1) == 1
    assert pool.probe(keys_of(tokens)) == (2, 0)
    assert pool.evict(1) == 1
    assert pool.probe(keys_of(tokens)) == (1, 0)


def test_pinned_pages_are_never_handed_out_or_evicted() -> None:
    pool = PagePool("full", 4)
    tokens = [1, 2, 3, 4]
    cached(pool, "a", tokens)
    pinned = pool.pin("b", keys_of(tokens))
    assert pool.stats() == PoolState("full", 4, free=2, evictable=0, used=2, pinned=2)
    assert pool.evict(10) == 0
    assert pool.flush() == 0
    fresh = pool.allocate("c", 2)
    assert set(fresh).isdisjoint(pinned)
    with pytest.raises(OutOfPages, match="0 free"):
        pool.allocate("c", 1)
    assert pool.probe(keys_of(tokens)) == (2, 2)
    pool.check()


def test_probe_counts_leading_pages_and_the_referenced_ones() -> None:
    pool = PagePool("full", 8)
    cached(pool, "a", [1, 2, 3, 4, 5, 6])
    assert pool.probe(keys_of([1, 2, 3, 4, 5, 6, 7, 8])) == (3, 0)
    assert pool.probe(keys_of([1, 2, 3, 4, 9, 9])) == (2, 0)
    assert pool.probe(keys_of([9, 9, 3, 4])) == (0, 0)
    assert pool.probe([]) == (0, 0)
    pool.pin("b", keys_of([1, 2]))
    assert pool.probe(keys_of([1, 2, 3, 4])) == (2, 1)


def test_probe_stops_at_a_gap() -> None:
    pool = PagePool("full", 4)
    tokens = [1, 2, 3, 4]
    pages = pool.allocate("a", 2)
    assert pool.commit("a", pages[1], keys_of(tokens)[1])
    assert pool.probe(keys_of(tokens)) == (0, 0)


def test_probe_changes_nothing_not_even_eviction_order() -> None:
    pool = PagePool("full", 2)
    cached(pool, "old", [1, 1])
    cached(pool, "new", [2, 2])
    before = state(pool)
    assert pool.probe(keys_of([1, 1])) == (1, 0)
    assert state(pool) == before
    pool.evict(1)
    assert pool.probe(keys_of([1, 1])) == (0, 0)
    assert pool.probe(keys_of([2, 2])) == (1, 0)


def test_pin_returns_the_cached_pages_in_order_and_leaves_the_evictable_set() -> None:
    pool = PagePool("full", 6)
    pages = cached(pool, "a", [1, 2, 3, 4, 5, 6])
    assert pool.pin("b", keys_of([1, 2, 3, 4])) == pages[:2]
    assert pool.table("b") == pages[:2]
    assert pool.stats() == PoolState("full", 6, free=3, evictable=1, used=2, pinned=2)
    pool.check()


def test_pin_nothing_registers_an_empty_owner() -> None:
    pool = PagePool("full", 2)
    assert pool.pin("a", []) == []
    assert pool.owners() == ["a"]
    assert pool.table("a") == []
    assert pool.allocate("a", 1) == pool.table("a")


def test_pin_more_than_held_names_the_counts_and_changes_nothing() -> None:
    pool = PagePool("full", 6)
    cached(pool, "a", [1, 2, 3, 4])
    before = state(pool)
    with pytest.raises(
        PrefixNotHeld,
        match=r"'b' asked to pin 3 prefix pages but the index holds only the first 2",
    ):
        pool.pin("b", keys_of([1, 2, 3, 4, 5, 6]))
    assert state(pool) == before
    assert "b" not in pool.owners()
    with pytest.raises(PrefixNotHeld) as err:
        pool.pin("b", keys_of([1, 2, 3, 4, 5, 6]))
    assert (err.value.held, err.value.asked) == (2, 3)
    pool.check()


def test_pin_twice_for_one_owner_is_refused() -> None:
    pool = PagePool("full", 4)
    cached(pool, "a", [1, 2])
    pool.pin("b", keys_of([1, 2]))
    before = state(pool)
    with pytest.raises(ValueError, match="owner 'b' already holds pages"):
        pool.pin("b", keys_of([1, 2]))
    pool.allocate("c", 1)
    with pytest.raises(ValueError, match="owner 'c' already holds pages"):
        pool.pin("c", [])
    assert pool.table("b") == before[1]["b"]
    pool.check()


def test_pin_refuses_repeated_keys() -> None:
    pool = PagePool("full", 4)
    cached(pool, "a", [1, 2])
    key = keys_of([1, 2])[0]
    with pytest.raises(ValueError, match="repeat a key"):
        pool.pin("b", [key, key])
    assert pool.stats().evictable == 1


def test_a_page_shared_by_two_owners_stays_used_until_both_release() -> None:
    pool = PagePool("full", 4)
    tokens = [1, 2, 3, 4]
    cached(pool, "a", tokens)
    shared = pool.pin("b", keys_of(tokens))
    assert pool.pin("c", keys_of(tokens[:2])) == shared[:1]
    assert pool.stats() == PoolState("full", 4, free=2, evictable=0, used=2, pinned=2)
    pool.release("b")
    assert pool.stats() == PoolState("full", 4, free=2, evictable=1, used=1, pinned=1)
    assert pool.probe(keys_of(tokens)) == (2, 1)
    assert set(pool.allocate("d", 3)).isdisjoint(shared[:1])
    pool.check()
    pool.release("c")
    assert pool.stats() == PoolState("full", 4, free=0, evictable=1, used=3, pinned=0)
    pool.check()


def test_commit_indexes_a_page_for_later_owners() -> None:
    pool = PagePool("full", 4)
    tokens = [1, 2, 3]
    pages = pool.allocate("a", 2)
    key = keys_of(tokens)[0]
    assert pool.commit("a", pages[0], key)
    assert pool.stats().pinned == 1
    assert pool.commit("a", pages[0], key), "recommitting the same key is idempotent"
    assert pool.stats().pinned == 1
    assert pool.pin("b", [key]) == pages[:1]
    pool.check()


def test_commit_of_an_already_indexed_key_keeps_the_page_private() -> None:
    pool = PagePool("full", 4)
    key = keys_of([1, 2])[0]
    a = pool.allocate("a", 1)
    b = pool.allocate("b", 1)
    assert pool.commit("a", a[0], key)
    assert not pool.commit("b", b[0], key)
    assert pool.stats().pinned == 1
    pool.release("b")
    assert pool.stats() == PoolState("full", 4, free=3, evictable=0, used=1, pinned=1)
    assert pool.pin("c", [key]) == a
    pool.check()


def test_commit_errors() -> None:
    pool = PagePool("full", 4)
    k1, k2 = keys_of([1, 2, 3, 4])
    a = pool.allocate("a", 1)
    b = pool.allocate("b", 1)
    with pytest.raises(ValueError, match=rf"page {b[0]} is not in the table of 'a'"):
        pool.commit("a", b[0], k1)
    with pytest.raises(KeyError, match="no owner 'ghost'"):
        pool.commit("ghost", a[0], k1)
    with pytest.raises(ValueError, match="page key must be non-empty bytes"):
        pool.commit("a", a[0], b"")
    assert pool.commit("a", a[0], k1)
    with pytest.raises(ValueError, match=rf"page {a[0]} is already indexed under another key"):
        pool.commit("a", a[0], k2)
    assert pool.probe([k1]) == (1, 1)
    assert pool.probe([k2]) == (0, 0)
    pool.check()


def test_release_of_a_partly_committed_owner() -> None:
    pool = PagePool("full", 5)
    tokens = [1, 2, 3, 4, 5]
    pages = pool.allocate("a", 3)
    keys = keys_of(tokens)
    assert pool.commit("a", pages[0], keys[0])
    pool.release("a")
    assert pool.stats() == PoolState("full", 5, free=4, evictable=1, used=0, pinned=0)
    assert pool.probe(keys) == (1, 0)
    assert pool.owners() == []
    pool.check()


def test_release_of_an_unknown_owner_is_a_no_op() -> None:
    pool = PagePool("full", 3)
    cached(pool, "a", [1, 2])
    before = state(pool)
    pool.release("a")
    pool.release("never")
    assert state(pool) == before


def test_evict_drops_lru_first_and_counts() -> None:
    pool = PagePool("full", 6)
    cached(pool, "a", [1, 1])
    cached(pool, "b", [2, 2])
    cached(pool, "c", [3, 3])
    assert pool.evict(0) == 0
    assert pool.evict(2) == 2
    assert [pool.probe(keys_of([t, t]))[0] for t in (1, 2, 3)] == [0, 0, 1]
    assert pool.evict(5) == 1
    assert pool.stats() == PoolState("full", 6, free=6, evictable=0, used=0, pinned=0)
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        pool.evict(-1)
    pool.check()


def test_a_repinned_page_returns_as_most_recently_used() -> None:
    pool = PagePool("full", 4)
    cached(pool, "a", [1, 1])
    cached(pool, "b", [2, 2])
    pool.pin("c", keys_of([1, 1]))
    pool.release("c")
    assert pool.evict(1) == 1
    assert pool.probe(keys_of([1, 1])) == (1, 0)
    assert pool.probe(keys_of([2, 2])) == (0, 0)


def test_flush_keeps_pinned_pages_indexed() -> None:
    pool = PagePool("full", 8)
    cached(pool, "a", [1, 2, 3, 4])
    cached(pool, "b", [5, 6, 7, 8])
    pool.pin("c", keys_of([1, 2]))
    live = pool.allocate("d", 1)
    assert pool.commit("d", live[0], keys_of([9, 9])[0])
    assert pool.flush() == 3
    assert pool.probe(keys_of([1, 2, 3, 4])) == (1, 1)
    assert pool.probe(keys_of([5, 6])) == (0, 0)
    assert pool.probe(keys_of([9, 9])) == (1, 1)
    assert pool.stats() == PoolState("full", 8, free=6, evictable=0, used=2, pinned=2)
    assert pool.flush() == 0
    pool.check()
    pool.release("c")
    pool.release("d")
    assert pool.stats() == PoolState("full", 8, free=6, evictable=2, used=0, pinned=0)
    pool.check()


def test_table_and_owners() -> None:
    pool = PagePool("swa", 4)
    pool.allocate("a", 1)
    pool.pin("b", [])
    assert pool.owners() == ["a", "b"]
    table = pool.table("a")
    table.append(99)
    assert pool.table("a") != table, "table() returns a copy"
    with pytest.raises(KeyError, match="pool 'swa' has no owner 'z'"):
        pool.table("z")


@pytest.mark.parametrize(
    ("args", "match"),
    [(("", 4), "pool name must be a non-empty string"), (("p", -1), "num_pages must be a non-negative int")],
)
def test_bad_pool_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PagePool(*args)


def test_bad_allocate_arguments() -> None:
    pool = PagePool("full", 4)
    with pytest.raises(ValueError, match="n must be a non-negative int, got -1"):
        pool.allocate("a", -1)
    with pytest.raises(ValueError, match="n must be a non-negative int, got 1.5"):
        pool.allocate("a", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owner must be a non-empty string"):
        pool.allocate("", 1)
    assert pool.stats().free == 4
    assert pool.owners() == []


def test_check_catches_a_corrupted_pool() -> None:
    pool = PagePool("full", 4)
    cached(pool, "a", [1, 2])
    pool.allocate("b", 1)
    pool._free.append(pool.table("b")[0])
    with pytest.raises(AssertionError, match="pages in two states"):
        pool.check()

    pool = PagePool("full", 4)
    pool.allocate("b", 1)
    pool._refs[pool.table("b")[0]] = 2
    with pytest.raises(AssertionError, match="has refcount 2 but 1 owners hold it"):
        pool.check()

    pool = PagePool("full", 4)
    pool._free.pop()
    with pytest.raises(AssertionError, match=r"free 3 \+ evictable 0 \+ used 0 != total 4"):
        pool.check()


def test_prefix_index_is_a_bijection() -> None:
    index = PrefixIndex()
    k1, k2 = keys_of([1, 2, 3, 4])
    assert index.insert(k1, 7)
    assert index.insert(k1, 7)
    assert not index.insert(k1, 8)
    with pytest.raises(ValueError, match="page 7 is already indexed"):
        index.insert(k2, 7)
    assert index.insert(k2, 8)
    assert index.match([k1, k2, b"other"]) == [7, 8]
    assert index.match([k2, k1]) == [8, 7]
    assert index.remove(7) == k1
    assert index.match([k1, k2]) == []
    assert (index.page_of(k2), index.key_of(8), len(index), k2 in index) == (8, k2, 1, True)
    with pytest.raises(KeyError, match="page 7 is not indexed"):
        index.remove(7)
    index.check()
