"""The page allocator of one KV pool: references, the free list and the LRU of evictable cached pages.

Every page is in exactly one state:
- free: unreferenced and not indexed; handed out first, lowest page first, so that the top of the pool
  stays free and a rebalance can take it (`movable`, `resize`).
- evictable: unreferenced but indexed (a cached prefix page); handed out only after the free list runs
  out, least recently released first, and dropped from the index when it is.
- used: referenced by at least one live owner (a request); never handed out, never evicted. A used page
  that is indexed is "pinned": several owners may share it when they pinned the same prefix.

Nothing here decides anything on its own: the rank carries out what the coordinator's plan says, and the
counts in `stats()` are what it reports. Every method checks its input before changing anything, so a
refused call (OutOfPages, PrefixNotHeld, ValueError) leaves the pool exactly as it was.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence

from lockstep.kv.prefix_index import PrefixIndex
from lockstep.steps import PoolState


class OutOfPages(RuntimeError):
    """Asked to allocate more pages than free + evictable; the pool did not change."""

    def __init__(self, pool: str, owner: str, asked: int, free: int, evictable: int) -> None:
        super().__init__(
            f"pool {pool!r}: {owner!r} asked for {asked} pages but only {free} free + {evictable} evictable"
            f" = {free + evictable} can be allocated"
        )
        self.pool, self.owner, self.asked, self.free, self.evictable = pool, owner, asked, free, evictable


class PrefixNotHeld(RuntimeError):
    """Asked to pin a prefix longer than the leading pages the index holds; the pool did not change."""

    def __init__(self, pool: str, owner: str, held: int, asked: int) -> None:
        super().__init__(
            f"pool {pool!r}: {owner!r} asked to pin {asked} prefix pages"
            f" but the index holds only the first {held}"
        )
        self.pool, self.owner, self.held, self.asked = pool, owner, held, asked


def _count(name: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class PagePool:
    """Pages 0..num_pages-1 of one KV pool, and which owner holds which of them in which order."""

    def __init__(self, name: str, num_pages: int) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"pool name must be a non-empty string, got {name!r}")
        self.name = name
        self.num_pages = _count("num_pages", num_pages)
        self._free: list[int] = list(range(num_pages))  # a heap: the lowest free page is handed out first
        self._limit = num_pages  # a fence: pages at or above it are not handed out (a pool about to shrink)
        self._fenced: set[int] = set()  # free pages at or above the fence
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_pages
        self._held = bytearray(num_pages)  # 1 where a page is referenced: finds the top held page in C
        self._tables: dict[str, list[int]] = {}
        self._index = PrefixIndex()
        self._pinned = 0

    def stats(self) -> PoolState:
        free, evictable, fenced = len(self._free), len(self._evictable), len(self._fenced)
        return PoolState(
            pool=self.name,
            total=self.num_pages,
            free=free,
            evictable=evictable,
            used=self.num_pages - free - evictable - fenced,
            pinned=self._pinned,
            movable=self.movable(),
            fenced=fenced,
        )

    @property
    def fence(self) -> int:
        """Pages below the fence are handed out; num_pages when there is no fence."""
        return self._limit

    def set_fence(self, limit: int) -> None:
        """Hand out no page at or above `limit` from now on, so that the pages held there drain as their
        requests finish and a later `resize` can take them; cached pages there are evicted now, and pages
        released there are freed rather than cached. `limit` = num_pages lifts the fence."""
        if type(limit) is not int or not 1 <= limit <= self.num_pages:
            raise ValueError(f"pool {self.name!r}: a fence must be in 1..{self.num_pages}, got {limit!r}")
        self._limit = limit
        for page in [p for p in self._evictable if p >= limit]:
            del self._evictable[page]
            self._index.remove(page)
            self._fenced.add(page)
        back = [p for p in self._fenced if p < limit]
        self._fenced = {p for p in self._fenced if p >= limit} | {p for p in self._free if p >= limit}
        self._free = [p for p in self._free if p < limit] + back
        heapq.heapify(self._free)

    def _give_back(self, page: int) -> None:
        """A page nobody references and no index names: free, or fenced when it sits above the fence."""
        if page >= self._limit:
            self._fenced.add(page)
        else:
            heapq.heappush(self._free, page)

    def movable(self) -> int:
        """Pages at the top of the pool that no owner references: what `resize` may take away now."""
        return self.num_pages - (self._held.rfind(1) + 1)

    def resize(self, num_pages: int) -> None:
        """Grow the pool with free pages, or shrink it by its top pages, evicting the cached ones among them.

        Refuses (ValueError, nothing changed) to take a page an owner references: pages never move under a
        live request.
        """
        _count("num_pages", num_pages)
        if num_pages < self.num_pages - self.movable():
            raise ValueError(f"pool {self.name!r}: cannot shrink to {num_pages} pages; pages up to "
                             f"{self.num_pages - self.movable() - 1} are held by live requests")
        for page in range(num_pages, self.num_pages):
            if page in self._evictable:
                del self._evictable[page]
                self._index.remove(page)
        self._free = [p for p in (*self._free, *self._fenced) if p < num_pages]
        self._free.extend(range(self.num_pages, num_pages))
        heapq.heapify(self._free)
        self._fenced = set()
        self._limit = num_pages  # the split that a fence prepared lifts it
        self._refs = self._refs[:num_pages] + [0] * max(0, num_pages - self.num_pages)
        self._held = self._held[:num_pages] + bytearray(max(0, num_pages - self.num_pages))
        self.num_pages = num_pages

    def probe(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(leading pages of the chain held, how many of those a live owner references); changes nothing.

        matched - pinned is how many pages pinning this prefix would take out of the evictable set.
        """
        pages = self._index.match(keys)
        return len(pages), sum(1 for p in pages if self._refs[p])

    def holding(self, keys: Sequence[bytes]) -> tuple[tuple[tuple[int, int], ...], int]:
        """(runs [a, b) of the keys' positions whose pages the index holds, how many of those a live owner
        references); changes nothing. Unlike `probe`, it looks past a gap: a sliding pool keeps a window's
        pages after the pages before them are gone."""
        runs: list[tuple[int, int]] = []
        pinned = 0
        for i, key in enumerate(keys):
            page = self._index.page_of(key)
            if page is None:
                continue
            pinned += self._refs[page] > 0
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return tuple(runs), pinned

    def pin(self, owner: str, keys: Sequence[bytes]) -> list[int]:
        """Start `owner` with a reference on the cached pages of the first len(keys) keys, in order.

        Refuses (PrefixNotHeld) rather than pin fewer: a rank that skipped tokens it does not hold would
        compute a different request than its peers.
        """
        self._check_new_owner(owner)
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError(f"pool {self.name!r}: the keys to pin for {owner!r} repeat a key")
        pages = self._index.match(keys)
        if len(pages) < len(keys):
            raise PrefixNotHeld(self.name, owner, len(pages), len(keys))
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
                self._pinned += 1
            self._refs[page] += 1
            self._held[page] = 1
        self._tables[owner] = list(pages)
        return list(pages)

    def allocate(self, owner: str, n: int) -> list[int]:
        """Append n fresh pages to `owner`'s table (a new owner starts with an empty one).

        Free pages go first; then cached pages nobody references, least recently used first.
        """
        _count("n", n)
        if owner not in self._tables:
            self._check_new_owner(owner)
        if n > len(self._free) + len(self._evictable):
            raise OutOfPages(self.name, owner, n, len(self._free), len(self._evictable))
        pages: list[int] = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._evictable.popitem(last=False)
                self._index.remove(page)
            self._refs[page] = 1
            self._held[page] = 1
            pages.append(page)
        self._tables.setdefault(owner, []).extend(pages)
        return pages

    def commit(self, owner: str, page: int, key: bytes) -> bool:
        """Index `owner`'s now-full `page` under `key`, so later requests can pin it.

        False if another page already holds `key` (two requests computed the same prefix): this page stays
        private and is freed on release, and the index keeps the first.
        """
        table = self._table(owner)
        if page not in reversed(table):
            raise ValueError(f"pool {self.name!r}: page {page!r} is not in the table of {owner!r}")
        was_indexed = self._index.key_of(page) is not None
        if not self._index.insert(key, page):
            return False
        if not was_indexed:
            self._pinned += 1
        return True

    def release(self, owner: str) -> None:
        """Drop `owner`'s references. Cached pages it leaves unreferenced become the most recently used.

        The tail of the table is released first so that, among these pages, the end of a prefix is evicted
        before its beginning (a page is useless once the page before it is gone). Unknown owner: no-op,
        since a release can be delivered for a request this rank already dropped.
        """
        table = self._tables.pop(owner, None)
        if table is None:
            return
        for page in reversed(table):
            self._unref(page)

    def _unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page]:
            return
        self._held[page] = 0
        if self._index.key_of(page) is not None:
            self._pinned -= 1
            if page < self._limit:
                self._evictable[page] = None
                return
            self._index.remove(page)
        self._give_back(page)

    def drop_front(self, owner: str, n: int) -> None:
        """Drop `owner`'s references on the first n pages of its table (a window moved past them); those
        left unreferenced go back as a release leaves them, cached ones as the most recently used."""
        table = self._table(owner)
        if _count("n", n) > len(table):
            raise ValueError(f"pool {self.name!r}: {owner!r} holds {len(table)} pages, cannot drop {n}")
        dropped, table[:] = table[:n], table[n:]
        for page in dropped:
            self._unref(page)

    def evict(self, n: int) -> int:
        """Drop up to n unreferenced cached pages from the index, least recently used first; how many."""
        _count("n", n)
        evicted = min(n, len(self._evictable))
        for _ in range(evicted):
            page, _ = self._evictable.popitem(last=False)
            self._index.remove(page)
            self._give_back(page)
        return evicted

    def flush(self) -> int:
        """Drop every unreferenced cached page; pinned pages stay indexed since live requests read them."""
        return self.evict(len(self._evictable))

    def table(self, owner: str) -> list[int]:
        """`owner`'s pages in position order (page i holds tokens [i*page_size, (i+1)*page_size))."""
        return list(self._table(owner))

    def held(self, owner: str) -> int:
        """How many pages `owner`'s table holds (its `table`'s length, without copying it)."""
        return len(self._table(owner))

    def owners(self) -> list[str]:
        return list(self._tables)

    def check(self) -> None:
        """Raise AssertionError unless every page is in exactly one state and every count agrees."""
        n = self.num_pages
        refs: Counter[int] = Counter()
        for owner, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"{self.name}: table of {owner!r} holds a page twice: {table}")
            refs.update(table)
        for page in range(n):
            if refs[page] != self._refs[page]:
                raise AssertionError(
                    f"{self.name}: page {page} has refcount {self._refs[page]}"
                    f" but {refs[page]} owners hold it"
                )
        if any(not 0 <= p < n for p in refs):
            raise AssertionError(f"{self.name}: a table holds a page outside 0..{n - 1}")
        if any(bool(self._held[p]) != bool(self._refs[p]) for p in range(n)) or len(self._held) != n:
            raise AssertionError(f"{self.name}: the held flags disagree with the refcounts")
        lim = self._limit
        if any(p >= lim for p in (*self._free, *self._evictable)) or any(p < lim for p in self._fenced):
            raise AssertionError(f"{self.name}: a page above the fence {lim} can be handed out, or one below is fenced")
        free, evictable = set(self._free) | self._fenced, set(self._evictable)
        used = {p for p in range(n) if self._refs[p]}
        if len(free) != len(self._free) + len(self._fenced):
            raise AssertionError(f"{self.name}: the free list holds a page twice")
        if free & evictable or free & used or evictable & used:
            raise AssertionError(
                f"{self.name}: pages in two states: free&evictable={sorted(free & evictable)}"
                f" free&used={sorted(free & used)} evictable&used={sorted(evictable & used)}"
            )
        if len(free) + len(evictable) + len(used) != n or not (free | evictable | used) <= set(range(n)):
            raise AssertionError(
                f"{self.name}: free {len(free)} + evictable {len(evictable)} + used {len(used)} != total {n}"
            )
        self._index.check()
        indexed = {page for _, page in self._index.items()}
        if free & indexed:
            raise AssertionError(f"{self.name}: free pages still indexed: {sorted(free & indexed)}")
        if not evictable <= indexed:
            raise AssertionError(f"{self.name}: evictable pages not indexed: {sorted(evictable - indexed)}")
        shared = {p for p, c in refs.items() if c > 1}
        if not shared <= indexed:
            raise AssertionError(f"{self.name}: pages shared but not cached: {sorted(shared - indexed)}")
        pinned = len(used & indexed)
        if pinned != self._pinned:
            raise AssertionError(
                f"{self.name}: pinned count {self._pinned} but {pinned} indexed pages are used"
            )

    def _table(self, owner: str) -> list[int]:
        table = self._tables.get(owner)
        if table is None:
            raise KeyError(f"pool {self.name!r} has no owner {owner!r}")
        return table

    def _check_new_owner(self, owner: str) -> None:
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        if owner in self._tables:
            raise ValueError(
                f"pool {self.name!r}: owner {owner!r} already holds pages; pin starts a new owner"
            )
