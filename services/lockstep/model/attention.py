"""Paged attention over a flattened, mixed batch of prefill chunks and decode tokens.

A batch is the concatenation of every sequence's new tokens, with no padding: a 300-token prefill chunk
and ten single decode tokens are one [T] tensor. `AttentionBatch` carries what attention needs to find
each sequence's keys in the page pool; `paged_attention` is the one seam a GPU kernel replaces.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

import torch
import torch.nn.functional as F

from lockstep.kv.paging import first_page, pages_for


@dataclass(frozen=True)
class AttentionBatch:
    positions: torch.Tensor  # [T] position of every new token
    slot_mapping: torch.Tensor  # [T] page * page_size + offset where its k/v is written
    last_token_indices: torch.Tensor  # [S] flat index of each sequence's last new token
    page_size: int
    starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    page_tensors: Mapping[int, torch.Tensor]  # the page tables of multi-token sequences, on the device
    max_page: int
    single_seqs: tuple[int, ...] = ()  # sequences with one new token (decode): attended in batched calls
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
        return _on(self.positions, [*self.token_rows, self.num_tokens])

    @cached_property
    def kv_lens(self) -> torch.Tensor:
        """[S] tokens each sequence attends over after this step (start + n)."""
        return _on(self.positions, [s + n for s, n in zip(self.starts, self.query_lens, strict=True)])

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """[S, max pages] page tables padded with -1, for kernels: made on first use, not every step."""
        return _on(self.positions, _padded(self.page_tables, -1)).view(self.num_seqs, -1)

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
        This runs every step for every sequence, so a decode span costs a few list operations and the batch
        goes to the device in one copy (a tensor per sequence cost more than the forward at batch 256).
        """
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not spans:
            raise ValueError("an attention batch needs at least one sequence")
        positions: list[int] = []
        slots: list[int] = []
        lasts: list[int] = []
        starts, lens, tables, singles, multis = [], [], [], [], []
        for i, (start, n, table) in enumerate(spans):
            table = _span_table(i, start, n, table, page_size, first_page(start, window, page_size))
            if n == 1:
                singles.append(i)
                positions.append(start)
                slots.append(table[start // page_size] * page_size + start % page_size)
            else:
                multis.append(i)
                positions.extend(range(start, start + n))
                slots.extend(table[p // page_size] * page_size + p % page_size
                             for p in range(start, start + n))
            lasts.append(len(positions) - 1)
            starts.append(start)
            lens.append(n)
            tables.append(table)
        t = len(positions)
        flat = _on(device, positions + slots + lasts + [p for i in multis for p in tables[i]])
        at, page_tensors = 2 * t + len(lasts), {}
        for i in multis:
            page_tensors[i] = flat[at:at + len(tables[i])]
            at += len(tables[i])
        return cls(
            positions=flat[:t],
            slot_mapping=flat[t:2 * t],
            last_token_indices=flat[2 * t:2 * t + len(lasts)],
            page_size=page_size,
            starts=tuple(starts),
            query_lens=tuple(lens),
            page_tables=tuple(tables),
            page_tensors=page_tensors,
            max_page=max(max(t) for t in tables),
            single_seqs=tuple(singles),
        )

    def single_gathers(self, window: int | None) -> tuple[_SingleGather, ...]:
        """The one-token sequences in groups of like KV length, for layers of this window; made once per step.

        Each group is one padded gather and one attention call, so padding costs gathered bytes and a group
        costs a call: `_length_groups` weighs the two, so mixed lengths are one call or a few, and one very
        long sequence among short ones does not make every row as long as it.
        """
        groups = self._gathers.get(window)
        if groups is None:
            ps = self.page_size
            lo = {i: 0 if window is None else max(0, self.starts[i] + 1 - window) for i in self.single_seqs}
            pages = {i: pages_for(self.starts[i] + 1, ps) - lo[i] // ps for i in self.single_seqs}
            members = _length_groups(pages, max(1, GROUP_CALL_TOKENS // ps))
            groups = _SingleGather.build_all(self, [sorted(m) for m in members], window)
            self._gathers[window] = groups
        return groups


GROUP_CALL_TOKENS = 256  # what one more attention call costs, in gathered key slots (measured on CPU, 2 threads)


def _length_groups(pages: Mapping[int, int], call_pages: int) -> list[list[int]]:
    """Sequences (id -> pages) in groups, longest first, minimising padded pages + call_pages per group.

    Groups are runs of the sequences sorted by length; a DP over the distinct lengths finds the best cuts
    (quadratic in them, so past 32 only every k-th is a candidate: a big batch's plan stays cheap).
    """
    order = sorted(pages, key=lambda i: -pages[i])
    cuts = [j for j in range(len(order)) if j == 0 or pages[order[j]] != pages[order[j - 1]]]
    cuts = cuts[::-(-len(cuts) // 32)] + [len(order)]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)  # best[c]: rows before cuts[c] grouped
    back = [0] * len(cuts)
    for c in range(1, len(cuts)):
        for b in range(c):
            cost = best[b] + (cuts[c] - cuts[b]) * pages[order[cuts[b]]] + call_pages
            if cost < best[c]:
                best[c], back[c] = cost, b
    members, c = [], len(cuts) - 1
    while c > 0:
        members.append(order[cuts[back[c]]: cuts[c]])
        c = back[c]
    return members[::-1]


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


def _on(where: torch.device | str | torch.Tensor, values: list[int]) -> torch.Tensor:
    """A long tensor of `values` on a device (or on a tensor's), in one host-to-device copy. Through an
    array: torch.tensor of a list of ints costs 3x more, and a step's page tables hold tens of thousands."""
    device = torch.device(where.device if isinstance(where, torch.Tensor) else where)
    host = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    return host if device.type == "cpu" else host.to(device)


def _padded(tables: Sequence[Sequence[int]], fill: int) -> list[int]:
    """The tables, each padded with `fill` to the longest, as one flat row-major list."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [fill] * (width - len(t))
    return flat


@dataclass(frozen=True)
class _SingleGather:
    """Pages to gather for a group of one-token sequences, padded to one width, and which slots each sees.

    Padding only over KV length: each sequence reads its own pages (from the first its window reaches),
    the rest of its row is page 0, masked out, so one SDPA call serves the group. A lone sequence needs
    no mask: its keys are sliced to exactly the positions it sees.
    """

    rows: torch.Tensor | None  # [S1] flat index of each sequence's query; None: the whole batch in order
    pages: torch.Tensor  # [S1, P] page ids
    mask: torch.Tensor | None  # [S1, 1, 1, kept slots] True where the query may look
    keep: slice  # gathered slots that hold keys some query sees
    _made: dict[object, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def buffer(self, name: str, cache: torch.Tensor) -> torch.Tensor:
        """Where `name` (k or v) pages are gathered: allocated on the first layer, reused by all others."""
        key = (name, cache.dtype, cache.device)
        buf = self._made.get(key)
        if buf is None:
            buf = self._made[key] = cache.new_empty((self.pages.numel(), *cache.shape[1:]))
        return buf

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as 0 / -inf in the queries' dtype, so SDPA does not convert it again on every layer."""
        if self.mask is None:
            return None
        bias = self._made.get(dtype)
        if bias is None:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias = self._made[dtype] = zeros.masked_fill(~self.mask, float("-inf"))
        return bias

    @classmethod
    def build_all(cls, batch: AttentionBatch, groups: list[list[int]], window: int | None
                  ) -> tuple[_SingleGather, ...]:
        """Every group's gather from one copy to the device and one mask over all of them, each group a view
        (a step at batch 256 has a score of groups; building each on its own cost more than its attention).
        Positions are counted from each sequence's first gathered page."""
        order = [i for m in groups for i in m]
        tables, lows, ends = _gathered(batch, order, window)
        spans, pages, a = [], [], 0
        for m in groups:
            spans.append((a, a + len(m), max(len(t) for t in tables[a:a + len(m)])))
            pages += _padded(tables[a:a + len(m)], 0)
            a += len(m)
        n, at = len(order), len(pages)
        whole = len(groups) == 1 and n == batch.num_seqs  # one group of the whole batch, in order: no rows
        rows = [] if whole else [batch.token_rows[i] for i in order]
        flat = _on(batch.positions, pages + rows + lows + ends)
        rows_t = None if whole else flat[at:at + n]
        at += len(rows)
        masked = [w for a, b, w in spans if b - a > 1]  # a group of one needs no mask: it is sliced exactly
        mask = None
        if masked:  # as wide as the widest such group (a very long sequence is usually a group of its own)
            slots = torch.arange(max(masked) * batch.page_size, device=flat.device)
            mask = slots < flat[at + n:at + 2 * n].unsqueeze(1)
            if window is not None:
                mask &= slots >= flat[at:at + n].unsqueeze(1)
        out, at = [], 0
        for a, b, w in spans:
            g_pages, g_rows = flat[at:at + (b - a) * w].view(b - a, w), None if whole else rows_t[a:b]
            at += (b - a) * w
            if b - a == 1:
                out.append(cls(rows=g_rows, pages=g_pages, mask=None, keep=slice(lows[a], ends[a])))
            else:
                hi = max(ends[a:b])
                out.append(cls(rows=g_rows, pages=g_pages, mask=mask[a:b, None, None, :hi], keep=slice(0, hi)))
        return tuple(out)


def _gathered(batch: AttentionBatch, seqs: list[int], window: int | None
              ) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """Per one-token sequence: the pages it gathers (from the first its window reaches), and the slots it
    sees among them, [low, end)."""
    ps = batch.page_size
    tables, lows, ends = [], [], []
    for i in seqs:
        end = batch.starts[i] + 1
        lo = 0 if window is None else max(0, end - window)
        first = lo // ps
        tables.append(batch.page_tables[i][first:])
        lows.append(lo - first * ps)
        ends.append(end - first * ps)
    return tables, lows, ends


PoolBatches = AttentionBatch | Mapping[str, AttentionBatch]


def batch_of(batches: PoolBatches, pool: str) -> AttentionBatch:
    """The batch whose page tables index `pool` (one AttentionBatch given: every pool shares it)."""
    if isinstance(batches, AttentionBatch):
        return batches
    batch = batches.get(pool)
    if batch is None:
        raise ValueError(f"no attention batch for KV pool {pool!r}; batches are for {sorted(batches)}")
    return batch


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
) -> None:
    """Store the new tokens' k/v ([T, kv_heads, head_dim]) into their slots of the page pool."""
    if batch.max_page >= k_cache.shape[0]:
        raise ValueError(f"page {batch.max_page} of this batch is past the cache's {k_cache.shape[0]} pages")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:])[batch.slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_slots, *v_cache.shape[2:])[batch.slot_mapping] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], each query over its own sequence's cached keys.

    Query j of a sequence sits at position start + j and sees key positions p with p <= start + j and,
    on a sliding layer, p > start + j - window. The k/v of this step must already be in the cache.
    """
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    groups = batch.single_gathers(window) if batch.single_seqs else ()
    if len(groups) == 1 and groups[0].rows is None:
        return _single_token_attention(q, k_cache, v_cache, groups[0], scale)
    out = torch.empty_like(q)
    for group in groups:
        out[group.rows] = _single_token_attention(q[group.rows], k_cache, v_cache, group, scale)
    page_size = batch.page_size
    a = 0
    for i, (start, n) in enumerate(zip(batch.starts, batch.query_lens, strict=True)):
        if n == 1:
            a += 1
            continue
        table = batch.page_tensors[i]
        kv_len = start + n
        lo = 0 if window is None else max(0, start + 1 - window)
        first_page = lo // page_size
        pages = table[first_page:]
        base = first_page * page_size
        # index_select, not k_cache[pages]: the same copy without advanced indexing's overhead (3x on CPU).
        k = torch.index_select(k_cache, 0, pages).view(-1, kv_heads, head_dim)[lo - base: kv_len - base]
        v = torch.index_select(v_cache, 0, pages).view(-1, kv_heads, head_dim)[lo - base: kv_len - base]
        qi = q[a: a + n].transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(start, kv_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(lo, kv_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        o = F.scaled_dot_product_attention(
            qi, k.transpose(0, 1).unsqueeze(0).to(q.dtype), v.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != kv_heads,
        )
        out[a: a + n] = o.squeeze(0).transpose(0, 1)
        a += n
    return out


def _single_token_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _SingleGather, scale: float
) -> torch.Tensor:
    """q: [S1, heads, head_dim], one query per sequence at its last position: one gather, one SDPA call.

    GQA without repeating K/V: a kv head's `group` query heads become that head's query rows (they sit at
    one position, so one mask serves them all), so SDPA sees q as [S1, kv_heads, group, D] against K/V as
    gathered, without enable_gqa (which some backends serve by repeating K/V) and with 1/group of the
    (sequence, head) work items of one query row per head (CPU SDPA runs a small GEMM pair per item).
    """
    s1, heads = q.shape[0], q.shape[1]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat = plan.pages.view(-1)
    k = torch.index_select(k_cache, 0, flat, out=plan.buffer("k", k_cache))
    v = torch.index_select(v_cache, 0, flat, out=plan.buffer("v", v_cache))
    k = k.view(s1, -1, kv_heads, head_dim)[:, plan.keep].transpose(1, 2).to(q.dtype)
    v = v.view(s1, -1, kv_heads, head_dim)[:, plan.keep].transpose(1, 2).to(q.dtype)
    rows = q.reshape(s1, kv_heads, heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(rows, k, v, attn_mask=plan.bias(q.dtype), scale=scale)
    return o.reshape(s1, heads, head_dim)
