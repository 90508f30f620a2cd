"""A decode step's gathers read pages off the block table with array arithmetic written for speed
(`_padded_pages`, `_group_sizes`, `_SingleGather.build_all`): each must give exactly what a plain, slow
statement of it gives, on any table, rows, lengths and window."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.model.attention_batch import AttentionBatch, _group_sizes, _padded_pages


def plain_group_sizes(pages: list[int], call_pages: int) -> list[int]:
    """`_group_sizes` as first written: the DP over the cuts in floats, one cost at a time."""
    distinct = [j for j in range(len(pages)) if j == 0 or pages[j] != pages[j - 1]]
    halves = {j for a, j in zip(distinct, distinct[1:], strict=False) if 2 * pages[j] < pages[a]}
    cuts = sorted({*distinct[::-(-len(distinct) // 32)], *halves}) + [len(pages)]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)
    back = [0] * len(cuts)
    for c in range(1, len(cuts)):
        for b in range(c):
            cost = best[b] + (cuts[c] - cuts[b]) * pages[cuts[b]] + call_pages
            if cost < best[c]:
                best[c], back[c] = cost, b
    sizes, c = [], len(cuts) - 1
    while c > 0:
        sizes.append(cuts[c] - cuts[back[c]])
        c = back[c]
    return sizes[::-1]


def plain_padded_pages(table, rows, firsts, counts, widths) -> list[int]:
    """Row by row: counts[r] pages of table row rows[r] from column firsts[r], then 0s up to widths[r]."""
    out: list[int] = []
    for r, first, n, w in zip(rows.tolist(), firsts.tolist(), counts.tolist(), widths.tolist(), strict=True):
        out += table[r, first:first + n].tolist() + [0] * (w - n)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=300), st.sampled_from([0, 1, 3, 16, 64, 1024]))
def test_group_sizes_are_the_plain_dps(pages, call_pages):
    pages.sort(reverse=True)
    assert _group_sizes(pages, call_pages) == plain_group_sizes(pages, call_pages)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_padded_pages_are_each_rows_pages_then_zeros(data):
    """Rows in any order, from any first column (a window's), padded to widths that may run past the table's
    last column (the padding is 0 whatever lies there)."""
    n_rows, cols = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 9))
    table = np.array(data.draw(st.lists(st.integers(-1, 10**6), min_size=n_rows * cols, max_size=n_rows * cols)),
                     dtype=np.int32).reshape(n_rows, cols)
    k = data.draw(st.integers(1, 20))
    rows = np.array(data.draw(st.lists(st.integers(0, n_rows - 1), min_size=k, max_size=k)), dtype=np.int64)
    firsts = np.array(data.draw(st.lists(st.integers(0, cols - 1), min_size=k, max_size=k)), dtype=np.int64)
    counts = np.array([data.draw(st.integers(1, cols - f)) for f in firsts.tolist()], dtype=np.int64)
    widths = np.array([data.draw(st.integers(c, c + 2 * cols)) for c in counts.tolist()], dtype=np.int64)
    got = _padded_pages(table, rows, firsts, counts, widths)
    assert got.dtype == table.dtype and got.tolist() == plain_padded_pages(table, rows, firsts, counts, widths)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=60), st.sampled_from([None, 1, 5, 16, 40, 300]),
       st.sampled_from([1, 4, 16]), st.sampled_from([1, 4, 16, 64]), st.randoms(use_true_random=False))
def test_each_decode_group_reads_its_rows_pages_and_sees_its_slots(starts, window, page_size, call_pages, rnd):
    """Every decode row once, in exactly one group: its table row's pages from the first its window reaches,
    then page 0; the group's query rows; and the slots its mask (and bias) lets it see."""
    n, cols = len(starts), max(s // page_size for s in starts) + 3
    rows = rnd.sample(range(n + 4), n)
    table = torch.tensor([[rnd.randrange(1, 10**6) for _ in range(cols)] for _ in range(n + 4)], dtype=torch.int32)
    batch = AttentionBatch.from_table(table, rows, starts, [1] * n, page_size)
    groups = _groups(batch, window, call_pages)
    seen = []
    for g in groups:
        queries = list(range(n)) if g.rows is None else g.rows.tolist()
        seen += queries
        bias = g.bias(torch.float32)
        for j, q in enumerate(queries):
            end = starts[q] + 1
            low = 0 if window is None else max(0, end - window)
            first, last = low // page_size, -(-end // page_size)
            width = g.pages.shape[1]
            assert g.pages[j].tolist() == table[rows[q], first:last].tolist() + [0] * (width - (last - first))
            slots = range(low - first * page_size, end - first * page_size)
            if g.mask is None:
                assert len(queries) == 1 and range(g.keep.start, g.keep.stop) == slots
            else:
                assert g.keep == slice(0, g.mask.shape[-1])
                assert [s for s, v in enumerate(g.mask[j, 0, 0].tolist()) if v] == list(slots)
                assert torch.equal(bias[j] == 0, g.mask[j])
    assert sorted(seen) == list(range(n))


def _groups(batch: AttentionBatch, window: int | None, call_pages: int):
    from lockstep.model import attention_batch

    return attention_batch._SingleGather.build_all(batch, window, call_pages)
