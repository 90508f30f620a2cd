"""Paged attention over a flattened, mixed batch of prefill chunks and decode tokens.

A batch is the concatenation of every sequence's new tokens, with no padding: a 300-token prefill chunk
and ten single decode tokens are one [T] tensor. `AttentionBatch` (attention_batch.py) carries what attention
needs to find each sequence's keys in the page pool; `paged_attention` is the one seam a GPU kernel replaces.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from lockstep.model.attention_batch import AttentionBatch, _SingleGather

__all__ = ["AttentionBatch", "PoolBatches", "batch_of", "paged_attention", "write_kv"]


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
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    lo, hi = batch.slot_bounds
    if lo < 0 or hi >= num_slots:
        page = lo // batch.page_size if lo < 0 else hi // batch.page_size
        raise ValueError(f"page {page} of this batch is past the cache's {k_cache.shape[0]} pages")
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
        table = batch.pages(i)
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
