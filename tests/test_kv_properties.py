"""Random interleavings of everything a rank does to one pool, checked against what the pages must hold.

The machine plays several requests whose prompts share prefixes. It tracks, outside the pool, which
tokens every page was filled with (the full prefix through that page, and its position) and which pages
live requests hold indexed. A pool that handed out a referenced page, evicted one, or kept a stale key
for a reused page would then pin a page whose contents differ from the prompt's, and the test says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from lockstep.kv.allocator import OutOfPages, PagePool, PrefixNotHeld
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.kv.paging import pages_for

PS = 2
NUM_PAGES = 6
SALT = key_salt("property-model", PS)
OWNERS = [f"req{i}" for i in range(4)]
PREFIXES = [(), (1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (7, 7)]

sequences = st.builds(
    lambda head, tail: head + tuple(tail),
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 1), max_size=5),
).filter(len)


@dataclass
class Live:
    tokens: tuple[int, ...]
    keys: list[bytes]
    table: list[int]
    indexed: dict[int, int] = field(default_factory=dict)  # position -> page this owner holds indexed
    tried: set[int] = field(default_factory=set)  # positions committed (indexed or kept private)

    @property
    def pages_needed(self) -> int:
        return pages_for(len(self.tokens), PS)


def contents(tokens: tuple[int, ...], position: int) -> tuple[tuple[int, ...], int]:
    """What a page at `position` of `tokens` holds: the prefix through it (its key commits to all of it)."""
    return tokens[: (position + 1) * PS], position


def common_pages(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Full pages two token sequences share from the start."""
    n = 0
    while (n + 1) * PS <= min(len(a), len(b)) and a[n * PS : (n + 1) * PS] == b[n * PS : (n + 1) * PS]:
        n += 1
    return n


class KvMachine(RuleBasedStateMachine):
    prompts = Bundle("prompts")

    @initialize()
    def start(self) -> None:
        self.pool = PagePool("full", NUM_PAGES)
        self.live: dict[str, Live] = {}
        self.filled: dict[int, tuple[tuple[int, ...], int]] = {}
        self.committed: dict[bytes, tuple[int, ...]] = {}
        self.seen: set[tuple[int, ...]] = set()

    def live_keys(self) -> dict[bytes, int]:
        """Keys of the indexed pages live owners reference: these can never be evicted."""
        return {o.keys[i]: page for o in self.live.values() for i, page in o.indexed.items()}

    def snapshot(self) -> tuple:
        probes = {seq: self.pool.probe(page_keys(seq, PS, SALT)) for seq in self.seen}
        return self.pool.stats(), {o: self.pool.table(o) for o in self.pool.owners()}, probes

    def check_probe(self, tokens: tuple[int, ...], keys: list[bytes]) -> tuple[int, int]:
        matched, pinned = self.pool.probe(keys)
        assert 0 <= pinned <= matched <= len(keys)
        for i in range(matched):
            assert self.committed.get(keys[i]) == tokens[: (i + 1) * PS], f"page {i} matched a prefix never committed"
        longest = max((common_pages(tokens, prefix) for prefix in self.committed.values()), default=0)
        assert matched <= longest, "matched past every committed sequence's common prefix"
        live = self.live_keys()
        held = 0
        while held < len(keys) and keys[held] in live:
            held += 1
        assert matched >= held, "a page a live owner holds indexed was lost from the index"
        assert pinned == sum(1 for k in keys[:matched] if k in live)
        return matched, pinned

    @rule(target=prompts, tokens=sequences)
    def new_prompt(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """Prompts are drawn again and again from this bundle, as a chat's turns reuse a system prompt."""
        return tokens

    @rule(
        owner=st.sampled_from(OWNERS),
        tokens=prompts,
        trim=st.sampled_from([0, 0, 0, 1, 2]),
        prefill=st.booleans(),
    )
    def admit(self, owner: str, tokens: tuple[int, ...], trim: int, prefill: bool) -> None:
        """Probe, refuse one page past the match, pin the (possibly shorter) agreed prefix, maybe prefill."""
        if owner in self.live:
            before = self.snapshot()
            with pytest.raises(ValueError, match="already holds pages"):
                self.pool.pin(owner, [])
            assert self.snapshot() == before
            return
        self.seen.add(tokens)
        keys = page_keys(tokens, PS, SALT)
        matched, _ = self.check_probe(tokens, keys)
        if matched < len(keys):
            before = self.snapshot()
            with pytest.raises(PrefixNotHeld) as err:
                self.pool.pin(owner, keys[: matched + 1])
            assert (err.value.held, err.value.asked) == (matched, matched + 1)
            assert self.snapshot() == before
        agreed = max(0, matched - trim)
        live = self.live_keys()
        pages = self.pool.pin(owner, keys[:agreed])
        assert len(pages) == agreed
        for i, page in enumerate(pages):
            assert self.filled[page] == contents(tokens, i), f"pinned page {page} holds other tokens"
            if keys[i] in live:
                assert live[keys[i]] == page
        self.live[owner] = Live(tokens, keys, list(pages), dict(enumerate(pages)), set(range(agreed)))
        if prefill:
            self.prefill_all(owner)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def grow(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[owner]
        self.allocate(owner, data.draw(st.integers(0, max(0, req.pages_needed - len(req.table)) + 1)))

    @rule(data=st.data())
    @precondition(lambda self: any(self.commitable(o) is not None for o in self.live.values()))
    def commit(self, data: st.DataObject) -> None:
        ready = sorted(o for o, r in self.live.items() if self.commitable(r) is not None)
        self.commit_next(data.draw(st.sampled_from(ready)))

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def prefill(self, data: st.DataObject) -> None:
        """A whole prefill in one step: every page the prompt still needs, then commit every full one."""
        self.prefill_all(data.draw(st.sampled_from(sorted(self.live))))

    def prefill_all(self, owner: str) -> None:
        req = self.live[owner]
        if self.allocate(owner, max(0, req.pages_needed - len(req.table))):
            while self.commitable(req) is not None:
                self.commit_next(owner)

    def allocate(self, owner: str, n: int) -> bool:
        req = self.live[owner]
        before = self.pool.stats()
        referenced = {p for o in self.live.values() for p in o.table}
        if n > before.free + before.evictable:
            snap = self.snapshot()
            with pytest.raises(OutOfPages) as err:
                self.pool.allocate(owner, n)
            assert (err.value.asked, err.value.free, err.value.evictable) == (
                n,
                before.free,
                before.evictable,
            )
            assert self.snapshot() == snap
            return False
        pages = self.pool.allocate(owner, n)
        assert len(pages) == len(set(pages)) == n
        assert referenced.isdisjoint(pages), "allocate handed out a page a live owner references"
        from_free = min(n, before.free)
        after = self.pool.stats()
        assert (after.free, after.evictable, after.used) == (
            before.free - from_free,
            before.evictable - (n - from_free),
            before.used + n,
        )
        for page in pages:
            self.filled[page] = contents(req.tokens, len(req.table))
            req.table.append(page)
        return True

    def commit_next(self, owner: str) -> None:
        req = self.live[owner]
        pos = self.commitable(req)
        page, key = req.table[pos], req.keys[pos]
        live = self.live_keys()
        pinned_before = self.pool.stats().pinned
        ok = self.pool.commit(owner, page, key)
        req.tried.add(pos)
        if key in live:
            assert not ok, "a key already held by a live page was indexed twice"
        if ok:
            req.indexed[pos] = page
            self.committed[key] = req.tokens[: (pos + 1) * PS]
            after = self.pool.stats()
            assert after.pinned == pinned_before + 1
            assert self.pool.commit(owner, page, key), "recommitting a page under its own key is a no-op"
            assert self.pool.stats() == after
        else:
            assert self.pool.stats().pinned == pinned_before

    @staticmethod
    def commitable(req: Live) -> int | None:
        """The first full, filled page this owner has not committed yet (ranks commit in position order)."""
        for pos in range(min(len(req.keys), len(req.table))):
            if pos not in req.tried:
                return pos
        return None

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def release(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(owner)
        others = {p for o in self.live.values() for p in o.table}
        alone = [p for p in req.table if p not in others]
        cached = sum(1 for p in alone if p in req.indexed.values())
        before = self.pool.stats()
        self.pool.release(owner)
        after = self.pool.stats()
        assert owner not in self.pool.owners()
        snap = self.snapshot()
        self.pool.release(owner)
        assert self.snapshot() == snap, "a second release (of an unknown owner) changed the pool"
        assert (after.used, after.evictable, after.free) == (
            before.used - len(alone),
            before.evictable + cached,
            before.free + len(alone) - cached,
        )

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        before = self.pool.stats()
        evicted = self.pool.evict(n)
        after = self.pool.stats()
        assert evicted == min(n, before.evictable)
        assert (after.free, after.evictable, after.used, after.pinned) == (
            before.free + evicted,
            before.evictable - evicted,
            before.used,
            before.pinned,
        )

    @rule()
    def flush(self) -> None:
        before = self.pool.stats()
        assert self.pool.flush() == before.evictable
        after = self.pool.stats()
        assert (after.free, after.evictable, after.pinned) == (
            before.free + before.evictable,
            0,
            before.pinned,
        )
        for seq in self.seen:
            keys = page_keys(seq, PS, SALT)
            matched, pinned = self.check_probe(seq, keys)
            assert matched == pinned, "an unreferenced page survived a flush"

    @rule(tokens=sequences)
    def probe(self, tokens: tuple[int, ...]) -> None:
        self.seen.add(tokens)
        before = self.snapshot()
        self.check_probe(tokens, page_keys(tokens, PS, SALT))
        assert self.snapshot() == before

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check()
        stats = self.pool.stats()
        assert stats.free + stats.evictable + stats.used == stats.total == NUM_PAGES
        assert self.pool.owners() == list(self.live)
        for owner, req in self.live.items():
            assert self.pool.table(owner) == req.table
        referenced = {p for o in self.live.values() for p in o.table}
        live_indexed = {p for o in self.live.values() for p in o.indexed.values()}
        assert stats.used == len(referenced)
        assert stats.pinned == len(live_indexed)
        tables = [p for o in self.live.values() for p in o.table]
        shared = {p for p in tables if tables.count(p) > 1}
        assert shared <= live_indexed, "a page is shared by two owners but is not a cached page"


KvMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_pool_state_machine = KvMachine.TestCase
