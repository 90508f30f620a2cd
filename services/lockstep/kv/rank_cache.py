"""One rank's page bookkeeping for the plans it carries out: the same code in the engine and in the tests.

A rank carries out plan k in the order of DESIGN.md's step protocol. Everything in that order that is
about pages rather than tensors is here, so the engine keeps only the agreement collective, the forward
and sampling, and a test drives the real bookkeeping with a fake forward:

    prepare(plan)     releases, pins of the admitted prefixes, pages for every chunk (or StepRefused)
                      ... the group agrees whether the step goes on ...
    undo_admits()     refused: what this step's admits pinned and allocated goes back
    block_tables      every request's pages as one row each (row(request)): what the forward reads
    advance(chunk)    the chunk ran: its positions are held and its full pages committed to the index
    finish(plan)      an operator's flush, then the probe answers and the pool counts for the report

The flush comes after the step's pins and commits, so it never takes a prefix that the plan's admits were
agreed on (pinned pages stay indexed), and the probes answer from the flushed state.

A hybrid model keeps one pool per attention kind: `full` holds a request's whole context, `sliding` only
the pages its window still reads (`kv.paging.first_page`): after each step the pages the window moved past
go back, cached ones to the evictable set. A prefix of L pages is pinned in `full` as pages 0..L-1 and in
`sliding` as the pages of the window before position L * page_size; both are held by key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lockstep.chunk_columns import ChunkColumns
from lockstep.kv.allocator import OutOfPages, PagePool, PrefixNotHeld
from lockstep.kv.block_table import BlockTable
from lockstep.kv.page_keys import next_key
from lockstep.kv.paging import POOL_FULL, POOL_SLIDING, first_page, pages_for
from lockstep.steps import Admit, Chunk, Plan, PoolState, ProbeAnswer

log = logging.getLogger("lockstep.kv")


class StepRefused(RuntimeError):
    """This rank cannot carry out the plan; the whole group then skips the step together.

    Raised by `prepare` with the rank in its text; `__cause__` is what refused (PrefixNotHeld,
    OutOfPages, a ValueError, or a bug), so a test can tell a refusal it planned from one it did not.
    """


@dataclass
class _Sequence:
    """What this rank holds of one request: positions [0, length) are in its pages.

    The first `committed` pages are committed (indexed, or kept private where the index already held the
    key), the last of them under the key `parent`; with prefix caching on, `pending` holds the tokens of
    positions [committed * page_size, length), the page not yet full. In a sliding pool the table holds
    pages `first`.. only.
    """

    length: int
    committed: int
    parent: bytes | None
    pending: list[int] = field(default_factory=list)
    first: int = 0  # the chain index of the first page the sliding pool's table holds
    row: int = 0  # its row in every pool's BlockTable


class RankCache:
    """One rank's KV pages as plans change them: its pools, their prefix indexes and what each request holds."""

    def __init__(
        self,
        pools: PagePool | Mapping[str, PagePool],
        page_size: int,
        salt: bytes,
        max_model_len: int,
        prefix_caching: bool = True,
        rank: int = 0,
        window: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pools = {pools.name: pools} if isinstance(pools, PagePool) else dict(pools)
        if not self.pools or set(self.pools) - {POOL_FULL, POOL_SLIDING}:
            raise ValueError(f"pools must be {POOL_FULL!r} and/or {POOL_SLIDING!r}, got {sorted(self.pools)}")
        if (POOL_SLIDING in self.pools) != (window > 0):
            raise ValueError(f"a {POOL_SLIDING!r} pool needs a window and a window needs the pool (window {window})")
        self.page_size = page_size
        self.salt = salt
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.rank = rank
        self.window = window
        self._seqs: dict[str, _Sequence] = {}
        # every live request's pages, one row each, as the forward's inputs read them (kv/block_table.py)
        self.block_tables = {name: BlockTable() for name in self.pools}
        self._free_rows: list[int] = []
        self._rows = 0  # rows handed out so far; freed ones are reused first
        self._admitted: list[str] = []  # this step's admits that were pinned: undone if the group refuses
        self._resized: dict[str, tuple[int, int]] = {}  # this step's rebalance: each pool's (total, fence) before

    @property
    def pool(self) -> PagePool:
        """The pool that holds whole contexts (`full`), or the one pool there is."""
        return self.pools.get(POOL_FULL) or next(iter(self.pools.values()))

    def prepare(self, plan: Plan) -> None:
        """Releases, then the pins of the admitted prefixes, then the pages of every chunk.

        Raises StepRefused when this rank cannot go on; the releases stay done, and what the admits
        pinned stays until `undo_admits`. Any exception becomes StepRefused: a rank must still reach the
        group's agreement, or its peers would wait for it in that collective forever.
        """
        self._admitted, self._resized = [], {}
        if plan.abstain:
            raise StepRefused(f"rank {self.rank} abstains from step {plan.step}: its coordinator is catching it "
                              "up to the step its peers are in")
        self._release(plan)
        try:
            if plan.pool_split or plan.pool_fence:
                self._rebalance(plan)
                return
            for admit in plan.admits:
                self._admit(admit)
            self._reserve_all(ChunkColumns.of(plan.batch))
        except (PrefixNotHeld, OutOfPages, StepRefused, ValueError) as exc:
            raise StepRefused(f"rank {self.rank}: {exc}") from exc
        except Exception as exc:
            log.exception("rank %d: preparing step %d failed", self.rank, plan.step)
            raise StepRefused(f"rank {self.rank}: {type(exc).__name__} while preparing the step: {exc}") from exc

    def undo_admits(self) -> None:
        """The group refused the step: drop what its admits pinned and allocated, so it can come again.

        Only admits this step carried out go back; a request refused for being admitted twice keeps what
        it held. Pages reserved for running requests stay theirs: their chunk comes again.
        """
        for request_id in self._admitted:
            self._drop(request_id)
        self._admitted = []
        for name, (total, fence) in self._resized.items():  # nothing was allocated after it: the pages are unheld
            self.pools[name].resize(total)
            self.pools[name].set_fence(fence)
        self._resized = {}

    def table(self, request_id: str, pool: str = POOL_FULL) -> list[int]:
        """The request's pages of `pool` in position order (page i holds positions [i * page_size, ...)),
        covering every position its chunk of this step writes; -1 for pages a window moved past."""
        seq = self._seqs.get(request_id)
        first = seq.first if seq is not None and pool == POOL_SLIDING else 0
        return [-1] * first + self.pools[pool].table(request_id)

    def row(self, request_id: str) -> int:
        """The request's row in every pool's `block_tables`."""
        return self._seqs[request_id].row

    def rows(self, request_ids: Iterable[str]) -> list[int]:
        """Each request's row (`row`), in one pass over a step's requests."""
        seqs = self._seqs
        return [seqs[rid].row for rid in request_ids]

    def advance(self, chunk: Chunk) -> None:
        """The chunk was computed: hold its positions and commit the pages it filled into the index."""
        self.advance_all((chunk,))

    def advance_all(self, chunks: Sequence[Chunk]) -> None:
        """Every chunk of a step was computed (`advance` each): one loop over the step's columns, since a decode
        step at batch 256 runs it per request and most of them only count a token (a page fills one step in
        page_size)."""
        b = ChunkColumns.of(chunks)
        seqs, ps, caching, tokens = self._seqs, self.page_size, self.prefix_caching, b.token_ids
        sliding = self.pools.get(POOL_SLIDING)
        at = None if b.one_token_each else b.offsets  # a decode step's token i is chunk i's
        for i, (rid, n) in enumerate(zip(b.request_ids, b.token_counts, strict=True)):
            seq = seqs[rid]
            seq.length += n
            if caching:
                if at is None:
                    seq.pending.append(tokens[i])
                else:
                    seq.pending += tokens[at[i]:at[i] + n]
                if len(seq.pending) >= ps:
                    self._commit(rid, seq)
            if sliding is not None:
                first = first_page(seq.length, self.window, ps)
                if first > seq.first:
                    sliding.drop_front(rid, first - seq.first)
                    self.block_tables[POOL_SLIDING].clear(seq.row, seq.first, first - seq.first)
                    seq.first = first

    def _commit(self, rid: str, seq: _Sequence) -> None:
        """Index every page its pending tokens filled, in every pool, under its chain key."""
        ps = self.page_size
        while len(seq.pending) >= ps:
            key = next_key(seq.parent, seq.pending[:ps], self.salt)
            for name, pool in self.pools.items():  # the page off the block table: a copy of its table cost O(context)
                pool.commit(rid, self.block_tables[name].page(seq.row, seq.committed), key)
            seq.parent = key
            seq.committed += 1
            del seq.pending[:ps]

    def finish(self, plan: Plan) -> tuple[tuple[ProbeAnswer, ...], tuple[PoolState, ...]]:
        """An operator's flush, if the plan asks, then (probe answers, pool counts) for the step's report."""
        self._admitted = []
        self._resized = {}
        if plan.flush_prefix_cache:
            for pool in self.pools.values():
                pool.flush()
        return tuple(self.probe(p.request_id, p.keys) for p in plan.probes), self.stats()

    def probe(self, request_id: str, keys: tuple[bytes, ...]) -> ProbeAnswer:
        """Which pages of this chain the pools hold (leading ones in `full`, any in `sliding`), and how many
        of those are pinned."""
        if not self.prefix_caching:
            return ProbeAnswer(request_id, 0, 0)
        full = self.pools.get(POOL_FULL)
        matched, pinned = full.probe(keys) if full is not None else (len(keys), 0)
        sliding = self.pools.get(POOL_SLIDING)
        if sliding is None:
            return ProbeAnswer(request_id, matched, pinned)
        runs, sliding_pinned = sliding.holding(keys)
        return ProbeAnswer(request_id, matched, pinned, runs, sliding_pinned)

    def stats(self) -> tuple[PoolState, ...]:
        """Every pool's page counts, as the report carries them."""
        return tuple(pool.stats() for pool in self.pools.values())

    def totals(self) -> tuple[tuple[str, int], ...]:
        """(pool name, total pages) of every pool: what the rank tells the coordinator it serves."""
        return tuple((name, pool.num_pages) for name, pool in self.pools.items())

    def check(self) -> None:
        """Raise AssertionError unless every pool is consistent and every request's pages cover what it
        holds (in a sliding pool: from the first page its window reads)."""
        for name, pool in self.pools.items():
            pool.check()
            if set(self._seqs) != set(pool.owners()):
                raise AssertionError(f"requests {sorted(self._seqs)} but {name} owners {sorted(pool.owners())}")
        for request_id, seq in self._seqs.items():
            for name in self.pools:
                pages = len(self.table(request_id, name))
                if pages < pages_for(seq.length, self.page_size) or seq.committed > pages:
                    raise AssertionError(f"{request_id}: {pages} {name} pages for {seq.length} positions, "
                                         f"{seq.committed} of them committed")
            if POOL_SLIDING in self.pools and seq.first != first_page(seq.length, self.window, self.page_size):
                raise AssertionError(f"{request_id}: holds sliding pages from {seq.first} at length {seq.length}")
            for name, table in self.block_tables.items():
                pages = self.table(request_id, name)
                if table.row(seq.row, len(pages)) != pages:
                    raise AssertionError(f"{request_id}: row {seq.row} of the {name} block table is "
                                         f"{table.row(seq.row, len(pages))}, its pages are {pages}")
        rows = [seq.row for seq in self._seqs.values()]
        if len(set(rows)) != len(rows) or set(rows) & set(self._free_rows):
            raise AssertionError(f"block table rows shared: live {sorted(rows)}, free {sorted(self._free_rows)}")

    def _rebalance(self, plan: Plan) -> None:
        """A rebalance: every pool to its new total and fence, all or none, in a plan that carries nothing else
        (so a group that refuses it undoes it whole). A pool shrinks only by pages no live request holds."""
        split, fence = dict(plan.pool_split), dict(plan.pool_fence)
        if plan.admits or plan.batch or plan.probes:
            raise StepRefused(f"step {plan.step} carries a rebalance and work; a rebalance step carries no work")
        if not split.keys() <= self.pools.keys() or not fence.keys() <= self.pools.keys():
            raise StepRefused(f"the rebalance names pools {sorted(split | fence)}; this rank has {sorted(self.pools)}")
        for name, pool in self.pools.items():
            total = split.get(name, pool.num_pages)
            if type(total) is not int or total < max(1, pool.num_pages - pool.movable()):
                raise StepRefused(f"pool {name!r} cannot take {total!r} pages: pages up to "
                                  f"{pool.num_pages - pool.movable() - 1} are held by live requests")
            if type(fence.get(name, total)) is not int or fence.get(name, total) < 1:
                raise StepRefused(f"pool {name!r}: fence {fence[name]!r} is not a page count >= 1")
        for name, pool in self.pools.items():
            self._resized[name] = (pool.num_pages, pool.fence)
            if name in split:
                pool.resize(split[name])
            if name in fence:  # a fence at or above this rank's total leaves all of it to hand out
                pool.set_fence(min(fence[name], pool.num_pages))

    def _drop(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        for name, pool in self.pools.items():
            if seq is not None:  # its row goes back blank: a later owner's columns before its own hold no page
                self.block_tables[name].clear(seq.row, 0, (seq.first if name == POOL_SLIDING else 0) +
                                              pool.held(request_id))
            pool.release(request_id)
        if seq is not None:
            self._free_rows.append(seq.row)

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        self._rows += 1
        for table in self.block_tables.values():
            table.grow(self._rows)
        return self._rows - 1

    def _release(self, plan: Plan) -> None:
        releases = [*self.pool.owners(), *self._seqs] if plan.release_all else plan.releases
        for request_id in releases:
            self._drop(request_id)
        if plan.release_all:  # a fence is the last coordinator's rebalance, which the new one does not know of
            for pool in self.pools.values():
                pool.set_fence(pool.num_pages)

    def _admit(self, admit: Admit) -> None:
        request_id, keys = admit.request_id, admit.prefix_keys
        if request_id in self._seqs:
            raise StepRefused(f"request {request_id} is admitted twice")
        if keys and not self.prefix_caching:
            raise StepRefused(f"request {request_id}: prefix caching is off on rank {self.rank}")
        length = len(keys) * self.page_size
        first = first_page(length, self.window, self.page_size) if POOL_SLIDING in self.pools else 0
        self._admitted.append(request_id)
        pinned = {name: pool.pin(request_id, keys[first:] if name == POOL_SLIDING else keys)
                  for name, pool in self.pools.items()}
        seq = _Sequence(length=length, committed=len(keys), parent=keys[-1] if keys else None, first=first,
                        row=self._take_row())
        self._seqs[request_id] = seq
        for name, pages in pinned.items():
            self.block_tables[name].write(seq.row, first if name == POOL_SLIDING else 0, pages)

    def _reserve_all(self, b: ChunkColumns) -> None:
        """The pages of every chunk of the step, each checked against what the rank holds. Most chunks of a decode
        step stay in a page their request holds already: one loop, a few comparisons each."""
        seqs, ps, limit = self._seqs, self.page_size, self.max_model_len
        for request_id, start, n in zip(b.request_ids, b.starts, b.token_counts, strict=True):
            seq = seqs.get(request_id)
            end = start + n
            if seq is None or start != seq.length or n < 1 or end > limit:
                raise StepRefused(self._chunk_refusal(request_id, seq, start, n))
            if -(-end // ps) > -(-start // ps):  # a page more (pages_for, inline): every pool covers [0, length)
                self._grow(request_id, seq, -(-end // ps))

    def _chunk_refusal(self, request_id: str, seq: _Sequence | None, start: int, n: int) -> str:
        """Why `_reserve_all` refuses a chunk."""
        if seq is None:
            return f"request {request_id} is not admitted"
        if start != seq.length:
            return f"request {request_id}: chunk starts at {start} but this rank holds {seq.length} tokens"
        if n < 1:
            return f"request {request_id}: empty chunk"
        return f"request {request_id}: position {start + n} is past the model's context"

    def _grow(self, request_id: str, seq: _Sequence, pages: int) -> None:
        """Every pool's pages of the request up to `pages`."""
        for name, pool in self.pools.items():
            held = pool.held(request_id) + (seq.first if name == POOL_SLIDING else 0)
            if pages > held:
                self.block_tables[name].write(seq.row, held, pool.allocate(request_id, pages - held))
