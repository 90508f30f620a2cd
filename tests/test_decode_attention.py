"""Batched decode attention: many one-token sequences in few padded calls must still each see exactly their
own positions (and window), for every GQA shape, against a plain per-sequence reference."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.model import attention_batch as attention
from lockstep.model.attention import AttentionBatch, paged_attention
from lockstep.model.attention_batch import _length_groups

TOL = 2e-5


def reference(q, k_cache, v_cache, table, start, n, window, scale, page_size):
    """Sequence by sequence, position by position: what every batched layout must reproduce."""
    group = q.shape[1] // k_cache.shape[2]
    slots = torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(start + n)])
    k = k_cache.reshape(-1, *k_cache.shape[2:])[slots]
    v = v_cache.reshape(-1, *v_cache.shape[2:])[slots]
    out = torch.empty_like(q)
    for j in range(n):
        pos = start + j
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            w = torch.softmax(k[lo: pos + 1, h // group] @ q[j, h] * scale, dim=0)
            out[j, h] = w @ v[lo: pos + 1, h // group]
    return out


def run_case(spans, heads, kv_heads, window, page_size=4, d=8, seed=0, seen=None):
    """`seen(span, table)`: the table as the batch gets it (the reference reads the whole one)."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum(math.ceil((s + n) / page_size) for s, n in spans) + 3
    perm = torch.randperm(pages - 1, generator=gen).add(1).tolist()  # page 0 is never a sequence's
    k_cache = torch.randn(pages, page_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(pages, page_size, kv_heads, d, generator=gen)
    k_cache[0], v_cache[0] = 1e4, 1e4  # what padding gathers: any leak past the mask shows at once
    tables = [[perm.pop() for _ in range(math.ceil((s + n) / page_size))] for s, n in spans]
    total = sum(n for _, n in spans)
    q = torch.randn(total, heads, d, generator=gen)
    given = [t if seen is None else seen(span, t) for span, t in zip(spans, tables, strict=True)]
    batch = AttentionBatch.build([(s, n, t) for (s, n), t in zip(spans, given, strict=True)], page_size,
                                 window=window)
    got = paged_attention(q, k_cache, v_cache, batch, window, 0.3)
    a = 0
    for (s, n), t in zip(spans, tables, strict=True):
        want = reference(q[a: a + n], k_cache, v_cache, t, s, n, window, 0.3, page_size)
        torch.testing.assert_close(got[a: a + n], want, atol=TOL, rtol=TOL)
        a += n
    return batch


LONG_AMONG_SHORT = [(s, 1) for s in (2, 5, 9, 11, 14, 3, 700, 8, 12, 1, 0, 6)]
MIXED_LENGTHS = [(s, 1) for s in (0, 3, 17, 40, 41, 64, 90, 120, 150, 200, 260, 31, 77, 5)]
WITH_PREFILL = [(0, 7), (40, 1), (3, 1), (10, 5), (99, 1), (0, 1), (57, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (9, 3), (6, 6), (16, 8)])
@pytest.mark.parametrize("window", [None, 1, 5, 64])
@pytest.mark.parametrize("spans", [LONG_AMONG_SHORT, MIXED_LENGTHS, WITH_PREFILL],
                         ids=["long-among-short", "mixed", "with-prefill"])
def test_batched_decode_sees_only_its_own_positions(spans, heads, kv_heads, window):
    run_case(spans, heads, kv_heads, window)


@pytest.mark.parametrize("call_tokens", [1, 10**9])
def test_any_grouping_gives_the_same_answer(monkeypatch, call_tokens):
    """One padded call for all rows, or one per distinct length: the masks, not the grouping, give the result."""
    monkeypatch.setattr(attention, "GROUP_CALL_TOKENS", call_tokens)
    batch = run_case(MIXED_LENGTHS, 9, 3, None, seed=3)
    groups = batch.single_gathers(None)
    assert (len(groups) == 1) == (call_tokens > 1)
    assert sorted(i for g in groups for i in _group_seqs(batch, g)) == list(range(len(MIXED_LENGTHS)))


def _group_seqs(batch, group):
    starts = batch.query_offsets[:-1].tolist()
    rows = range(batch.num_seqs) if group.rows is None else group.rows.tolist()
    return [starts.index(r) for r in rows]


def test_a_very_long_sequence_gets_its_own_group():
    batch = run_case(LONG_AMONG_SHORT, 4, 2, None, page_size=16)
    groups = batch.single_gathers(None)
    sizes = sorted(g.pages.shape[0] for g in groups)
    assert sizes == [1, len(LONG_AMONG_SHORT) - 1]
    # the short ones' mask is as wide as they are, not as the long one (a row of 700 slots for each of them)
    (mask,) = [g.mask for g in groups if g.mask is not None]
    assert mask.untyped_storage().nbytes() <= len(LONG_AMONG_SHORT) * 16


@pytest.mark.parametrize("window", [5, 9])
def test_pages_a_window_has_left_may_be_gone(window):
    """RankCache gives -1 for the pages a sliding window moved past (they went back to the pool): the batch
    and its gathers must never read them, for decodes and prefill chunks alike."""
    spans = [(s, 1) for s in (3, 17, 40, 26, 9)] + [(12, 6), (0, 5)]

    def gone(span, table):
        return [-1 if p < max(0, span[0] + 1 - window) // 4 else t for p, t in enumerate(table)]

    batch = run_case(spans, 4, 2, window, seen=gone)
    assert all(int(g.pages.min()) >= 0 for g in batch.single_gathers(window))


def test_length_groups_cover_every_sequence_once_longest_first():
    pages = {i: p for i, p in enumerate([1, 50, 2, 2, 49, 3, 1, 300])}
    groups = _length_groups(pages, call_pages=8)
    assert sorted(i for g in groups for i in g) == sorted(pages)
    assert groups[0] == [7]  # 300 pages: padding 7 others to it would cost far more than a call
    firsts = [pages[g[0]] for g in groups]
    assert firsts == sorted(firsts, reverse=True)
    assert _length_groups({5: 4}, call_pages=8) == [[5]]


def test_length_groups_stay_whole_past_the_dp_cap():
    """Many distinct lengths (past the DP's 32 candidate cuts): still every sequence once, runs longest first."""
    pages = {i: (i * 37) % 211 + 1 for i in range(300)}
    groups = _length_groups(pages, call_pages=1)
    assert sorted(i for g in groups for i in g) == sorted(pages)
    assert 1 < len(groups) <= 32
    flat = [pages[i] for g in groups for i in g]
    assert flat == sorted(flat, reverse=True)


def test_a_steps_tables_are_rows_of_one_table_and_read_only_as_far_as_each_sequence_reaches():
    """The engine's batch is index arithmetic on its RankCache's block table (no page table per request per
    step): rows in any order, and columns past a sequence's pages holding another request's pages (a row
    handed out again) or garbage, must give exactly the answer the sequences' own tables give."""
    spans = [(s, 1) for s in (0, 3, 17, 40, 41, 64, 90, 120, 150, 200, 260, 31, 77, 5)] + [(0, 6), (9, 3)]
    for window in (None, 9):
        want = run_case(spans, 4, 2, window, seed=5)
        gen = torch.Generator().manual_seed(1)
        rows = torch.randperm(len(spans) + 5, generator=gen)[:len(spans)].tolist()
        table = torch.randint(-5, 10**6, (len(spans) + 5, want.block_tables.shape[1] + 3), generator=gen)
        for i, (s, n) in enumerate(spans):
            need = math.ceil((s + n) / 4)
            table[rows[i], :need] = want.block_tables[i, :need]
        got = AttentionBatch.from_table(table, rows, [s for s, _ in spans], [n for _, n in spans], 4)
        assert got.slot_mapping.tolist() == want.slot_mapping.tolist()
        assert got.block_tables.tolist() == want.block_tables.tolist()
        for g, w in zip(got.single_gathers(window), want.single_gathers(window), strict=True):
            assert g.pages.tolist() == w.pages.tolist() and g.keep == w.keep
            assert (g.mask is None and w.mask is None) or torch.equal(g.mask, w.mask)
        assert min(int(g.pages.min()) for g in got.single_gathers(window)) >= 0
    assert want.kv_lens.tolist() == [s + n for s, n in spans]
    width = want.block_tables.shape[1]
    assert want.block_tables[15].tolist() == want.table[want.rows[15], :3].tolist() + [-1] * (width - 3)


def test_a_device_batch_is_one_copy():
    """Off the CPU the host's index tensors go over as one buffer, each a view of it."""
    parts = [torch.arange(5), torch.arange(6).view(2, 3), torch.tensor([7])]
    moved = attention._to_device(parts, "meta")
    assert [tuple(p.shape) for p in moved] == [(5,), (2, 3), (1,)]
    assert all(p.device.type == "meta" for p in moved) and len({id(p._base) for p in moved}) == 1
    assert attention._to_device(parts, "cpu") is parts


def test_a_gpu_groups_decode_rows_into_fewer_calls_than_the_cpu():
    """A call costs launches on a GPU, not gathered slots: rows the CPU splits by length share a call there,
    while a very long row among short ones still gets its own (its padding would cost more than a call)."""
    from lockstep.device import attention_call_tokens

    cpu, gpu = attention_call_tokens("cpu"), attention_call_tokens(torch.device("cuda", 0))
    assert cpu == 256 and gpu > 16 * cpu
    pages = {i: 1 + i * 3 for i in range(40)}  # 1..118 pages of 16 tokens
    assert len(_length_groups(pages, gpu // 16)) <= 2 < len(_length_groups(pages, cpu // 16))
    assert _length_groups({**{i: 2 for i in range(255)}, 255: 2048}, gpu // 16)[0] == [255]


def test_a_very_long_sequence_is_alone_even_among_many_distinct_lengths():
    """Past 32 distinct lengths the grouping only cuts at some of them; a long outlier must still be a group of
    its own (with others, every one of them is padded to it, and the step's mask is as wide as it: 33 MB and
    60 ms a step at batch 256 with one 128k-token request)."""
    pages = {i: 7 + i for i in range(200)}  # 200 distinct lengths
    pages[200] = 8192
    groups = _length_groups(pages, call_pages=16)
    assert groups[0] == [200]
    assert sorted(i for g in groups for i in g) == sorted(pages)
    starts = [16 * p - 1 for p in pages.values()]
    batch = AttentionBatch.build([(s, 1, list(range(1, -(-(s + 1) // 16) + 1))) for s in starts], 16)
    masks = [g.mask for g in batch.single_gathers(None) if g.mask is not None]
    assert max(m.untyped_storage().nbytes() for m in masks) <= len(starts) * 16 * 210


def test_a_long_group_among_short_ones_gets_its_own_mask():
    """Two long rows (one group) among many short ones: one mask as wide as the long ones for every row would
    be far more than the groups need; each group then gets its own, and every answer is still exact."""
    spans = [(s, 1) for s in (7000, 6990)] + [(s, 1) for s in range(3, 400, 3)]
    for window in (None, 3000):
        batch = run_case(spans, 4, 2, window, page_size=16)
        masks = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes()
                 for g in batch.single_gathers(window) if (m := g.mask) is not None}
        assert len(masks) >= 2 and sum(masks.values()) < 2 * 7001 + len(spans) * 400
        assert all(int(g.pages.min()) >= 0 for g in batch.single_gathers(window))


def test_a_batch_off_the_table_refuses_an_empty_sequence_or_a_negative_start():
    """The decode path takes every sequence of length one as a decode row: an empty one must be refused, not
    read as one token (nothing upstream sends one; the table's batch must not depend on that)."""
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    with pytest.raises(ValueError, match="a token"):
        AttentionBatch.from_table(table, [0, 1, 2], [3, 5, 2], [1, 0, 1], 4)
    with pytest.raises(ValueError, match="start"):
        AttentionBatch.from_table(table, [0, 1], [3, -1], [1, 1], 4)
    assert AttentionBatch.from_table(table, [0, 1, 2], [3, 5, 2], [1, 1, 1], 4).single_seqs == (0, 1, 2)


@pytest.mark.parametrize("window", [None, 1, 15, 16, 40, 3000])
def test_a_groups_bias_is_its_mask_as_zero_and_minus_infinity_in_every_dtype(window):
    """The layers read each group's bias, made by arithmetic on slot numbers rather than from the mask: it must
    be 0 exactly where the mask is True and -inf elsewhere, in each dtype the queries may have."""
    spans = [(s, 1) for s in (7000, 6990, 517, 511, 64, 63, 15, 0)] + [(s, 1) for s in range(3, 400, 7)]
    batch = AttentionBatch.build([(s, n, list(range(1, -(-(s + n) // 16) + 1))) for s, n in spans], 16)
    groups = [g for g in batch.single_gathers(window) if g.mask is not None]
    assert groups
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for g in groups:
            expected = torch.zeros(g.mask.shape, dtype=dtype).masked_fill_(~g.mask, float("-inf"))
            bias = g.bias(dtype)
            assert bias.dtype == dtype and torch.equal(bias, expected)


def test_a_batch_off_the_table_refuses_a_row_outside_the_table():
    """A negative row would read the table's last row (numpy wraps negative indices) and one past the end
    another request's or nothing: either is refused, not read (from a review's fuzz)."""
    table = torch.tensor([[3, 4, -1, -1], [5, -1, -1, -1]], dtype=torch.int32)
    for rows in ([-1], [2], [0, -2]):
        with pytest.raises(ValueError, match="row"):
            AttentionBatch.from_table(table, rows, [0] * len(rows), [1] * len(rows), 4)
        with pytest.raises(ValueError, match="row"):
            AttentionBatch.from_table(table, rows, [0] * len(rows), [2] * len(rows), 4)


def test_a_device_batch_keeps_the_parts_types_and_values():
    """The one buffer holds every part's values, in the type torch.cat would give them."""
    parts = [torch.arange(3, dtype=torch.int32), torch.tensor([9, 8], dtype=torch.long)]
    flat = attention.host_staging(5, torch.long, torch.device("cpu"))
    torch.cat(parts, out=flat)
    assert flat.tolist() == [0, 1, 2, 9, 8] and not flat.is_pinned()
    moved = attention._to_device(parts, "meta")
    assert [p.dtype for p in moved] == [torch.long, torch.long]
