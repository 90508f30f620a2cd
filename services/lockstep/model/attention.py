"""Paged attention over a flattened, mixed batch of prefill chunks and decode tokens.

A batch is the concatenation of every sequence's new tokens, with no padding: a 300-token prefill chunk
and ten single decode tokens are one [T] tensor. `AttentionBatch` carries what attention needs to find
each sequence's keys in the page pool; `paged_attention` is the one seam a GPU kernel replaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    ) -> AttentionBatch:
        """spans: (start, n, page table covering positions [0, start + n)) per sequence, in batch order."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not spans:
            raise ValueError("an attention batch needs at least one sequence")
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0]
        starts, lens, tables = [], [], []
        for i, (start, n, table) in enumerate(spans):
            table = tuple(int(p) for p in table)
            if start < 0 or n < 1:
                raise ValueError(f"sequence {i}: start must be >= 0 and n >= 1, got start={start} n={n}")
            needed = -(-(start + n) // page_size)
            if len(table) < needed:
                raise ValueError(
                    f"sequence {i}: page table has {len(table)} pages but positions [0, {start + n}) "
                    f"need {needed} of {page_size} tokens")
            if any(p < 0 for p in table[:needed]):
                raise ValueError(f"sequence {i}: negative page id in its page table {table[:needed]}")
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // page_size] * page_size + pos % page_size)
            offsets.append(offsets[-1] + n)
            starts.append(start)
            lens.append(n)
            tables.append(table[:needed])
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
        )


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
    out = torch.empty_like(q)
    page_size = batch.page_size
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    a = 0
    for start, n, table in zip(batch.starts, batch.query_lens, batch.page_tensors, strict=True):
        kv_len = start + n
        lo = 0 if window is None else max(0, start + 1 - window)
        first_page = lo // page_size
        pages = table[first_page:]
        base = first_page * page_size
        k = k_cache[pages].reshape(-1, kv_heads, head_dim)[lo - base: kv_len - base]
        v = v_cache[pages].reshape(-1, kv_heads, head_dim)[lo - base: kv_len - base]
        qi = q[a: a + n].transpose(0, 1).unsqueeze(0)
        mask = None
        if n > 1 or (window is not None and kv_len - lo > window):
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
