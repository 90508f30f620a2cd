"""Per-draw seeds: numpy's wrapping uint64 arithmetic equals splitmix64 computed with Python's exact integers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lockstep.model.draw_seeds import draw_seeds, row_seeds, seed_bases
from lockstep.steps import SamplingParams

M64 = (1 << 64) - 1


def splitmix(base: int, index: int) -> int:
    x = (base + index * 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@given(st.lists(st.tuples(st.integers(0, M64), st.integers(0, 1 << 40)), min_size=1, max_size=40))
def test_a_step_of_seeds_is_splitmix64_of_each_row(rows):
    bases, indexes = zip(*rows, strict=True)
    assert draw_seeds(bases, indexes) == [splitmix(b, i) for b, i in rows]


def test_a_rows_seed_depends_on_its_request_and_index_alone():
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0, seed=7)
    alone = row_seeds(["a"], [hot], [3])
    together = row_seeds(["x", "a", "y"], [hot, hot, greedy], [9, 3, 4])
    assert together[1] == alone[0] != 0 and together[2] == 0  # a greedy row draws nothing
    assert together[0] != together[1]  # another index of the same seed: another draw
    assert row_seeds(["b"], [hot], [3]) == alone  # the seed decides, not the id
    unseeded = SamplingParams(temperature=1.0)
    assert row_seeds(["a"], [unseeded], [3]) != row_seeds(["b"], [unseeded], [3])  # no seed: the id decides


def test_nearby_seeds_start_far_apart_streams():
    bases = seed_bases(["r"] * 4, [1, 2, 3, None])
    assert len(set(bases)) == 4 and all(0 <= b <= M64 for b in bases)
    assert min(abs(a - b) for a in bases for b in bases if a != b) > 1 << 32
