"""What attention needs to find each sequence's keys in the page pool, built once per step per KV pool.

`AttentionBatch` flattens a mixed batch of prefill chunks and decode tokens (no padding) and reads each
sequence's pages off a block table (`kv.block_table.BlockTable`: one row per request, kept by the RankCache as
pages change), so a step's inputs are index arithmetic, not a page table per request. Its decode rows are
gathered in groups of like length (`single_gathers`), each group one padded attention call.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, reduce
from itertools import accumulate, chain

import numpy as np
import torch

from lockstep.device import attention_call_tokens, host_staging, to_device
from lockstep.kv.paging import first_page, pages_for
from lockstep.model.decode_masks import DecodeMasks, pattern_span


@dataclass(frozen=True)
class AttentionBatch:
    positions: torch.Tensor  # [T] position of every new token
    slot_mapping: torch.Tensor  # [T] page * page_size + offset where its k/v is written
    last_token_indices: torch.Tensor  # [S] flat index of each sequence's last new token
    page_size: int
    starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    # [R, C] the host block table the pages are read from, row rows[i] sequence i's pages by position. It is
    # read while the step runs (RankCache writes it only between steps), and only as far as each sequence
    # reaches: past that a row may hold anything (another request's pages, or -1)
    table: torch.Tensor
    rows: tuple[int, ...]
    slot_bounds: tuple[int, int]  # the least and the greatest slot written, checked against the cache
    single_seqs: tuple[int, ...] = ()  # sequences with one new token (decode): attended in batched calls
    # [3, S1] host (numpy): each one-token sequence's table row, position and flat query row (single_gathers' input)
    singles: np.ndarray | None = field(default=None, compare=False, repr=False)
    _gathers: dict[int | None, tuple[_SingleGather, ...]] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @cached_property
    def token_rows(self) -> tuple[int, ...]:
        """Where each sequence's tokens start in the flat batch, on the host."""
        return tuple(accumulate(self.query_lens[:-1], initial=0))

    @cached_property
    def query_offsets(self) -> torch.Tensor:
        """[S + 1] where each sequence's tokens start in the flat batch (for kernels; the CPU path needs none)."""
        return long_tensor(self.positions, [*self.token_rows, self.num_tokens])

    @cached_property
    def kv_lens(self) -> torch.Tensor:
        """[S] tokens each sequence attends over after this step (start + n)."""
        return long_tensor(self.positions, [s + n for s, n in zip(self.starts, self.query_lens, strict=True)])

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """[S, W] page tables padded with -1 past each sequence's pages, W the most any needs: for kernels,
        made on first use (one very long sequence makes every row as wide)."""
        needed = [pages_for(s + n, self.page_size) for s, n in zip(self.starts, self.query_lens, strict=True)]
        host = self.table.index_select(0, long_tensor("cpu", list(self.rows)))[:, :max(needed)]
        cols = torch.arange(host.shape[1])
        return host.masked_fill(cols >= long_tensor("cpu", needed).unsqueeze(1), -1).to(self.positions.device)

    @cached_property
    def _multi_pages(self) -> dict[int, torch.Tensor]:
        """The pages of each multi-token sequence (prefill chunks), on the device in one copy."""
        multis = [i for i, n in enumerate(self.query_lens) if n > 1]
        parts = [self.table[self.rows[i], :pages_for(self.starts[i] + self.query_lens[i], self.page_size)]
                 for i in multis]
        return dict(zip(multis, _to_device(parts, self.positions.device), strict=True))

    def pages(self, i: int) -> torch.Tensor:
        """Sequence i's pages covering positions [0, start + n) (a multi-token sequence's)."""
        return self._multi_pages[i]

    @classmethod
    def build(
        cls,
        spans: Sequence[tuple[int, int, Sequence[int]]],
        page_size: int,
        device: torch.device | str = "cpu",
        window: int | None = None,
    ) -> AttentionBatch:
        """spans: (start, n, page table covering positions [0, start + n)) per sequence, in batch order.

        With a `window` (a sliding pool's batch), pages before the first one the window reads may be -1.
        Each table is checked, since here they come from the caller; the engine's come from its RankCache,
        which keeps them (`from_table`).
        """
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not spans:
            raise ValueError("an attention batch needs at least one sequence")
        tables = [_span_table(i, start, n, table, page_size, first_page(start, window, page_size))
                  for i, (start, n, table) in enumerate(spans)]
        host = long_tensor("cpu", _padded(tables, -1)).view(len(tables), -1)
        return cls.from_table(host, range(len(spans)), [s for s, _, _ in spans], [n for _, n, _ in spans],
                              page_size, device)

    @classmethod
    def from_table(
        cls,
        table: torch.Tensor,
        rows: Sequence[int],
        starts: Sequence[int],
        lens: Sequence[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionBatch:
        """Sequence i runs positions [starts[i], starts[i] + lens[i]) with the pages of row rows[i] of `table`
        (a host [R, C] tensor of page ids by position: `kv.block_table.BlockTable`, which covers them).

        This runs every step: a sequence costs a few list appends, the rest is index arithmetic on the table
        on the host, and the batch goes to the device in one copy.
        """
        if not rows:
            raise ValueError("an attention batch needs at least one sequence")
        n = len(rows)
        if not n == len(starts) == len(lens):
            raise ValueError(f"{n} rows, {len(starts)} starts and {len(lens)} lengths for one batch")
        if lens.count(1) == n:  # a decode step: one token per sequence, so every column is an array operation
            singles = np.fromiter(chain(rows, starts, range(n)), np.int64, 3 * n).reshape(3, n)  # row, pos, query
            (row_lo, start_lo), (row_hi, start_hi) = singles[:2].min(1).tolist(), singles[:2].max(1).tolist()
            len_lo, end = 1, start_hi + 1
        else:
            singles = None
            row_lo, row_hi, start_lo, len_lo = min(rows), max(rows), min(starts), min(lens)
            end = max(map(operator.add, starts, lens))
        if len_lo < 1 or start_lo < 0:
            raise ValueError(f"every sequence needs a start >= 0 and a token, got starts {start_lo}.., "
                             f"lengths {len_lo}..")
        if row_lo < 0 or row_hi >= table.shape[0]:  # numpy would wrap a negative one to the last row
            raise ValueError(f"rows {row_lo}..{row_hi} of a table of {table.shape[0]} rows")
        cols = table.shape[1]
        if pages_for(end, page_size) > cols:
            raise ValueError(f"positions up to {end} need more than the table's {cols} pages")
        if singles is not None:
            pos, lasts = singles[1], singles[2]
            page, offset = np.divmod(pos, page_size)
            cells = singles[0] * cols + page
            single_seqs = tuple(range(n))
        else:
            pos, cells, lasts, singles, single_seqs = _mixed_columns(rows, starts, lens, cols, page_size)
            offset = pos % page_size
        slots = table.numpy().reshape(-1)[cells].astype(np.int64) * page_size + offset
        parts = _to_device([torch.from_numpy(pos), torch.from_numpy(slots), torch.from_numpy(lasts)], device)
        return cls(positions=parts[0], slot_mapping=parts[1], last_token_indices=parts[2], page_size=page_size,
                   starts=tuple(starts), query_lens=tuple(lens), table=table, rows=tuple(rows),
                   slot_bounds=(int(slots.min()), int(slots.max())), single_seqs=single_seqs, singles=singles)

    def single_gathers(self, window: int | None) -> tuple[_SingleGather, ...]:
        """The one-token sequences in groups of like KV length, for layers of this window; made once per step.

        Each group is one padded gather and one attention call, so padding costs gathered bytes and a group
        costs a call: `_length_groups` weighs the two, so mixed lengths are one call or a few, and one very
        long sequence among short ones does not make every row as long as it.
        """
        groups = self._gathers.get(window)
        if groups is None:
            call = GROUP_CALL_TOKENS or attention_call_tokens(self.positions.device)
            groups = self._gathers[window] = _SingleGather.build_all(self, window, max(1, call // self.page_size))
        return groups


def _mixed_columns(rows: Sequence[int], starts: Sequence[int], lens: Sequence[int], cols: int, page_size: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
    """A batch with prefill chunks: (positions, flat table cells, last token indices, the one-token sequences'
    [3, S1] columns, which sequences those are), a few list appends per sequence."""
    positions: list[int] = []
    cells: list[int] = []  # where each token's page is in the flat table
    lasts: list[int] = []
    singles: list[int] = []
    for i, (start, n, row) in enumerate(zip(starts, lens, rows, strict=True)):
        at = row * cols
        if n == 1:
            singles.append(i)
            positions.append(start)
            cells.append(at + start // page_size)
        else:
            positions.extend(range(start, start + n))
            cells.extend(at + p // page_size for p in range(start, start + n))
        lasts.append(len(positions) - 1)
    t, s1 = len(positions), len(singles)
    host = np.array(positions + cells + lasts + [rows[i] for i in singles] + [starts[i] for i in singles] +
                    [lasts[i] for i in singles], dtype=np.int64)
    return host[:t], host[t:2 * t], host[2 * t:2 * t + len(lasts)], host[2 * t + len(lasts):].reshape(3, s1), \
        tuple(singles)


GROUP_CALL_TOKENS = 0  # what one more attention call costs, in gathered key slots; 0: the device's own


def _length_groups(pages: Mapping[int, int], call_pages: int) -> list[list[int]]:
    """Sequences (id -> pages) in groups, longest first, minimising padded pages + call_pages per group
    (`_group_sizes` over them sorted by length)."""
    order = sorted(pages, key=lambda i: -pages[i])
    members, a = [], 0
    for k in _group_sizes([pages[i] for i in order], call_pages):
        members.append(order[a:a + k])
        a += k
    return members


def _group_sizes(pages: list[int], call_pages: int) -> list[int]:
    """How many of `pages` (sorted longest first) each group takes, minimising padded pages + call_pages a group.

    Groups are runs of the sorted lengths; a DP over the distinct lengths finds the best cuts (quadratic in
    them, so past 32 only every k-th is a candidate: a big batch's plan stays cheap), and wherever the length
    halves (at most a score of those), so an outlier is never padded with others.
    """
    distinct = [j for j in range(len(pages)) if j == 0 or pages[j] != pages[j - 1]]
    halves = {j for a, j in zip(distinct, distinct[1:], strict=False) if 2 * pages[j] < pages[a]}
    cuts = sorted({*distinct[::-(-len(distinct) // 32)], *halves})
    heights = [pages[b] for b in cuts]  # a group starting at cut b is heights[b] pages wide
    cuts.append(len(pages))
    best = [0] * len(cuts)  # best[c]: the least cost of grouping the rows before cuts[c] (integers: exact)
    back = [0] * len(cuts)
    for c in range(1, len(cuts)):  # the first cut of the fewest cost wins a tie
        end = cuts[c]
        least, at = end * heights[0], 0
        for b in range(1, c):
            cost = best[b] + (end - cuts[b]) * heights[b]
            if cost < least:
                least, at = cost, b
        best[c], back[c] = least + call_pages, at
    sizes, c = [], len(cuts) - 1
    while c > 0:
        sizes.append(cuts[c] - cuts[back[c]])
        c = back[c]
    return sizes[::-1]


def _span_table(i: int, start: int, n: int, table: Sequence[int], page_size: int, first: int) -> tuple[int, ...]:
    """Sequence i's pages covering positions [0, start + n), checked from page `first` on (the first its
    window reads): a bad table must fail here, not index another sequence's k/v."""
    if start < 0 or n < 1:
        raise ValueError(f"sequence {i}: start must be >= 0 and n >= 1, got start={start} n={n}")
    needed = pages_for(start + n, page_size)
    if len(table) < needed:
        raise ValueError(
            f"sequence {i}: page table has {len(table)} pages but positions [0, {start + n}) "
            f"need {needed} of {page_size} tokens")
    table = tuple(table[:needed])
    if first < needed and min(table[first:]) < 0:
        raise ValueError(f"sequence {i}: negative page id in its page table {table[first:]}")
    return table


def long_tensor(where: torch.device | str | torch.Tensor, values: list[int]) -> torch.Tensor:
    """A long tensor of `values` on a device (or on a tensor's), in one host-to-device copy. Through an
    array: torch.tensor of a list of ints costs 3x more, and a step's page tables hold tens of thousands."""
    device = torch.device(where.device if isinstance(where, torch.Tensor) else where)
    host = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    return to_device(host, device)


def _to_device(parts: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors on `device`, in one copy (views of one buffer there); as they are on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return parts
    flats = [p.reshape(-1) for p in parts]
    dtype = reduce(torch.promote_types, (f.dtype for f in flats))
    host = host_staging(sum(f.numel() for f in flats), dtype, device)
    flat = to_device(torch.cat(flats, out=host), device)
    out, at = [], 0
    for p in parts:
        out.append(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()
    return out


def _padded(tables: Sequence[Sequence[int]], fill: int) -> list[int]:
    """The tables, each padded with `fill` to the longest, as one flat row-major list."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [fill] * (width - len(t))
    return flat


@dataclass(slots=True, eq=False)
class _SingleGather:
    """Pages to gather for a group of one-token sequences, padded to one width, and which slots each sees.
    Not frozen, though never changed once built: a step builds a score of them, and a frozen dataclass's
    `__init__` costs several times a slotted one's.

    Padding only over KV length: each sequence reads its own pages (from the first its window reaches),
    the rest of its row is page 0, masked out, so one SDPA call serves the group. A lone sequence needs
    no mask: its keys are sliced to exactly the positions it sees.
    """

    rows: torch.Tensor | None  # [S1] flat index of each sequence's query; None: the whole batch in order
    pages: torch.Tensor  # [S1, P] page ids
    keep: slice  # gathered slots that hold keys some query sees
    masks: DecodeMasks | None = None  # the step's masks; this group's is masks.masks[mask_index]
    mask_index: int = -1
    _made: dict[object, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[S1, 1, 1, kept slots] True where the query may look; None for a lone sequence."""
        return None if self.masks is None else self.masks.masks[self.mask_index]

    def buffer(self, name: str, cache: torch.Tensor) -> torch.Tensor:
        """Where `name` (k or v) pages are gathered: allocated on the first layer, reused by all others."""
        key = (name, cache.dtype, cache.device)
        buf = self._made.get(key)
        if buf is None:
            buf = self._made[key] = cache.new_empty((self.pages.numel(), *cache.shape[1:]))
        return buf

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as 0 / -inf in the queries' dtype."""
        return None if self.masks is None else self.masks.bias(self.mask_index, dtype)

    @classmethod
    def build_all(cls, batch: AttentionBatch, window: int | None, call_pages: int) -> tuple[_SingleGather, ...]:
        """Every group's pages and mask in a few tensor operations over all of them, each group's a view (a
        step at batch 256 has a score of groups; slicing each out on its own cost more than its attention).
        The pages are read off the host table and go to the device in one copy. Positions are counted from
        each sequence's first gathered page: the first its window reaches."""
        rows, starts, queries = batch.singles
        n, ps = rows.shape[0], batch.page_size
        cols = np.empty((7, n), np.int64)  # row, first page, pages, first slot seen, end slot, query, bias start
        cols[0], cols[5] = rows, queries  # (each computed into its row: a stack of copies cost as much again)
        ends = np.add(starts, 1, out=cols[4])
        counts = np.floor_divide(starts + ps, ps, out=cols[2])
        if window is None:  # every row from its first page (the bias starts are set below)
            cols[1] = cols[3] = 0
        else:
            lows = np.maximum(ends - window, 0)
            firsts = np.floor_divide(lows, ps, out=cols[1])
            base = firsts * ps
            counts -= firsts
            np.subtract(lows, base, out=cols[3])
            ends -= base
        order = np.argsort(-cols[2], kind="stable")
        longest = cols[2][order].tolist()
        sizes = _group_sizes(longest, call_pages)
        whole = len(sizes) == 1 and n == batch.num_seqs  # one group of the whole batch, in order: no rows
        if not whole:
            cols = cols[:, order]
        lo, hi = cols[3].tolist(), cols[4].tolist()
        span = pattern_span(max(hi), window)
        np.subtract(sum(span), cols[4], out=cols[6])
        spans, a = [], 0  # per group: (its first row, its rows, pages wide, slots its mask spans: 0 alone)
        for k in sizes:
            spans.append((a, k, longest[a], max(hi[a:a + k]) if k > 1 else 0))
            a += k
        widths = np.repeat([w for _, _, w, _ in spans], sizes)
        pages = _padded_pages(batch.table.numpy(), cols[0], cols[1], cols[2], widths)
        if pages.size and pages.min() < 0:
            raise ValueError("a decode row's pages include -1: its block table row does not cover its positions")
        pages, rest = _to_device([torch.from_numpy(pages), torch.from_numpy(cols[4:])], batch.positions.device)
        masks = DecodeMasks.build(rest[0], rest[2], span, [(k, h) for _, k, _, h in spans], window)
        out, at = [], pages.storage_offset()  # each group's a view (as_strided, split: the cheapest)
        queries = [None] * len(sizes) if whole else rest[1].split(sizes)
        for i, ((a, k, w, h), g_rows) in enumerate(zip(spans, queries, strict=True)):
            g_pages = pages.as_strided((k, w), (w, 1), at)
            at += k * w
            if h:
                out.append(cls(rows=g_rows, pages=g_pages, keep=slice(0, h), masks=masks, mask_index=i))
            else:
                out.append(cls(rows=g_rows, pages=g_pages, keep=slice(lo[a], hi[a])))
        return tuple(out)


def _padded_pages(table: np.ndarray, rows: np.ndarray, firsts: np.ndarray, counts: np.ndarray, widths: np.ndarray
                  ) -> np.ndarray:
    """For each r: pages firsts[r].. of table row rows[r] (counts[r] of them, then page 0 up to widths[r]:
    padding, masked out), laid out one after another; read straight off the table, never a row's whole width.
    In numpy: a step's host index arithmetic is a score of small array operations, each a third of torch's;
    a row's cells are its output positions plus one offset per row (two repeats, not a gather per column)."""
    cols, ends = table.shape[1], np.cumsum(widths)
    lead = ends - widths  # where each row's pages start in the output
    at = np.arange(ends[-1] if ends.size else 0)
    cells = at + np.repeat(rows * cols + firsts - lead, widths)
    if ends.size and (firsts + widths).max() > cols:  # padding past a row's end: read in bounds, zeroed below
        np.minimum(cells, table.size - 1, out=cells)
    pages = table.reshape(-1).take(cells)
    pages *= at < np.repeat(lead + counts, widths)
    return pages
