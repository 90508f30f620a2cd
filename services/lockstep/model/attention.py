"""Paged attention over a flattened, mixed batch of prefill chunks and decode tokens.

A batch is the concatenation of every sequence's new tokens, with no padding: a 300-token prefill chunk
and ten single decode tokens are one [T] tensor. `AttentionBatch` carries what attention needs to find
each sequence's keys in the page pool; `paged_attention` is the one seam a GPU kernel replaces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lockstep.kv.paging import first_page, pages_for


@dataclass(frozen=True)
class AttentionBatch:
    positions: torch.Tensor  # [T] position of every new token
    slot_mapping: torch.Tensor  # [T] page * page_size + offset where its k/v is written
    query_offsets: torch.Tensor  # [S + 1] where each sequence's tokens start in the flat batch
    kv_lens: torch.Tensor  # [S] tokens each sequence attends over after this step (start + n)
    last_token_indices: torch.Tensor  # [S] flat index of each sequence's last new token
    block_tables: torch.Tensor  # [S, max pages] page tables, padded with -1 (for kernels)
    page_size: int
    starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    page_tensors: tuple[torch.Tensor, ...]  # each sequence's page table on the device, made once per step
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
        """
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not spans:
            raise ValueError("an attention batch needs at least one sequence")
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0]
        starts, lens, tables, singles = [], [], [], []
        for i, (start, n, table) in enumerate(spans):
            table = _span_table(i, start, n, table, page_size, first_page(start, window, page_size))
            if n == 1:
                singles.append(i)
                positions.append(start)
                slots.append(table[start // page_size] * page_size + start % page_size)
            else:
                positions.extend(range(start, start + n))
                slots.extend(table[p // page_size] * page_size + p % page_size
                             for p in range(start, start + n))
            offsets.append(offsets[-1] + n)
            starts.append(start)
            lens.append(n)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [list(t) + [-1] * (width - len(t)) for t in tables]

        def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            query_offsets=as_tensor(offsets),
            kv_lens=as_tensor([s + n for s, n in zip(starts, lens, strict=True)]),
            last_token_indices=as_tensor([o - 1 for o in offsets[1:]]),
            block_tables=as_tensor(padded),
            page_size=page_size,
            starts=tuple(starts),
            query_lens=tuple(lens),
            page_tables=tuple(tables),
            page_tensors=tuple(as_tensor(list(t)) for t in tables),
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
            groups = tuple(_SingleGather.build(self, sorted(m), window) for m in members)
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
    table = tuple(int(p) for p in table)
    if len(table) < needed:
        raise ValueError(
            f"sequence {i}: page table has {len(table)} pages but positions [0, {start + n}) "
            f"need {needed} of {page_size} tokens")
    if any(p < 0 for p in table[first:needed]):
        raise ValueError(f"sequence {i}: negative page id in its page table {table[first:needed]}")
    return table[:needed]


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
    def build(cls, batch: AttentionBatch, seqs: list[int], window: int | None) -> _SingleGather:
        ps = batch.page_size
        firsts, lows, ends, tables = [], [], [], []
        for i in seqs:
            end = batch.starts[i] + 1
            lo = 0 if window is None else max(0, end - window)
            firsts.append(lo // ps)
            lows.append(lo)
            ends.append(end)
            tables.append(batch.page_tables[i][lo // ps:])
        width = max(len(t) for t in tables)
        device = batch.positions.device
        padded = [list(t) + [0] * (width - len(t)) for t in tables]
        pages = torch.tensor(padded, dtype=torch.long, device=device)
        rows = None
        if len(seqs) < batch.num_seqs:
            offsets = [0]
            for n in batch.query_lens:
                offsets.append(offsets[-1] + n)
            rows = torch.tensor([offsets[i] for i in seqs], dtype=torch.long, device=device)
        if len(seqs) == 1:
            base = firsts[0] * ps
            return cls(rows=rows, pages=pages, mask=None, keep=slice(lows[0] - base, ends[0] - base))
        pos = torch.arange(width * ps, device=device) + torch.tensor(firsts, device=device).unsqueeze(1) * ps
        lo_t = torch.tensor(lows, device=device).unsqueeze(1)
        end_t = torch.tensor(ends, device=device).unsqueeze(1)
        hi = max(e - f * ps for e, f in zip(ends, firsts, strict=True))
        mask = ((pos >= lo_t) & (pos < end_t))[:, :hi]
        return cls(rows=rows, pages=pages, mask=mask.view(len(seqs), 1, 1, hi), keep=slice(0, hi))


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
    for start, n, table in zip(batch.starts, batch.query_lens, batch.page_tensors, strict=True):
        if n == 1:
            a += 1
            continue
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
