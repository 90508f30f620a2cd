"""The draw for logits on an accelerator (model/device_sampling.py), run here on CPU tensors: it follows the
softmax, top-k / top-p keep exactly the CPU path's allowed set, a row's token depends on its logits, params
and seed alone, and rows with no finite maximum get the CPU path's answer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.model import device_sampling
from lockstep.model.device_sampling import race_draw, uniforms
from lockstep.model.sampling import _draw_on_device, _Row, allowed_mask
from lockstep.steps import SamplingParams


def race(row: torch.Tensor, p: SamplingParams, seeds: range) -> list[int]:
    r = _Row.of(p, row.shape[-1])
    return [race_draw(row.unsqueeze(0), [r.temperature], [r.top_k], [r.top_p], [s])[0] for s in seeds]


def test_uniforms_are_a_pinned_function_of_the_seed_and_the_token_in_the_open_unit_interval():
    u = uniforms(torch.tensor([0, 1, -5, 2**62]), 50_000)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[:, :1000], uniforms(torch.tensor([0, 1, -5, 2**62]), 1000))  # not on the vocab size
    assert not torch.equal(u[0], u[1])
    for row in u:
        assert abs(row.mean().item() - 0.5) < 0.01 and abs(row.var().item() - 1 / 12) < 0.005
        assert abs((row < 0.001).float().mean().item() - 0.001) < 0.0006  # the far tail is not short
    # pinned: a change here changes every token a GPU draws for a given seed
    assert [round(v, 6) for v in uniforms(torch.tensor([7]), 4)[0].tolist()] == PINNED_U
    for seed in (7, -(2**63) + 12345, 2**62 + 1):  # the int64 arithmetic is splitmix64's, bit for bit
        assert uniforms(torch.tensor([seed]), 5)[0].tolist() == [splitmix64_uniform(seed, i) for i in range(1, 6)]


PINNED_U = [0.38983, 0.016788, 0.900761, 0.58293]


def splitmix64_uniform(seed: int, counter: int) -> float:
    """The reference, in Python's unbounded integers: splitmix64's output for `counter`, top 53 bits."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15 * counter) & mask
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
    z ^= z >> 31
    return ((z >> 11) + 0.5) * 2.0 ** -53


def test_the_race_follows_the_softmax_and_never_draws_a_minus_infinity():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    tokens = race(torch.log(probs), SamplingParams(temperature=1.0), range(6000))
    for t, want in enumerate(probs.tolist()):
        assert abs(tokens.count(t) / len(tokens) - want) < 0.025, (t, tokens.count(t))
    assert 5 not in tokens


def test_temperature_and_filters_shape_the_race_as_on_the_cpu():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top2 = race(row, SamplingParams(temperature=1.0, top_k=2), range(4000))
    assert abs(top2.count(0) / 4000 - 4 / 7) < 0.03 and 2 not in top2 and 3 not in top2
    nucleus = race(row, SamplingParams(temperature=1.0, top_p=0.75), range(4000))
    assert abs(nucleus.count(0) / 4000 - 4 / 9) < 0.03 and 3 not in nucleus
    hot = race(torch.tensor([0.0, math.log(3.0)]), SamplingParams(temperature=50.0), range(2000))
    assert 0.45 < sum(hot) / 2000 < 0.55


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), top_k=st.integers(0, 80), top_p=st.floats(0.05, 1.0),
       temperature=st.floats(0.1, 3.0), ties=st.booleans())
def test_the_race_draws_only_inside_the_cpu_paths_allowed_set(seed, top_k, top_p, temperature, ties):
    """Same top-k, same nucleus, same tie-breaking by token id: allowed_mask is the CPU path's definition."""
    row = 3 * torch.randn(64, generator=torch.Generator().manual_seed(seed))
    if ties:
        row = row.round()  # many equal logits straddle the cuts
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    allowed = allowed_mask(row, p)
    assert all(allowed[t] for t in race(row, p, range(seed, seed + 40)))


def test_a_rows_token_does_not_depend_on_its_neighbours_and_a_seed_draws_it_again(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = 2 * torch.randn(16, 4096, generator=gen)
    params = [_Row.of(SamplingParams(temperature=0.5 + i / 8, top_k=(i % 3) * 40, top_p=1 - (i % 4) / 5), 4096)
              for i in range(16)]
    seeds = [1000 + i for i in range(16)]
    together = race_draw(x, [r.temperature for r in params], [r.top_k for r in params], [r.top_p for r in params],
                         seeds)
    alone = [race_draw(x[i:i + 1], [r.temperature], [r.top_k], [r.top_p], [seeds[i]])[0]
             for i, r in enumerate(params)]
    assert together == alone
    monkeypatch.setattr(device_sampling, "BLOCK_ELEMENTS", 3 * 4096)  # blocks of 3 rows: the same tokens
    assert race_draw(x, [r.temperature for r in params], [r.top_k for r in params], [r.top_p for r in params],
                     seeds) == together
    assert together == race_draw(x, [r.temperature for r in params], [r.top_k for r in params],
                                 [r.top_p for r in params], seeds)
    other = race_draw(x, [r.temperature for r in params], [r.top_k for r in params], [r.top_p for r in params],
                      [s + 1 for s in seeds])
    assert other != together


@pytest.mark.parametrize("row, allowed", [
    ([float("nan")] * 4, {0}),  # nothing finite: token 0, the CPU path's answer
    ([0.0, float("inf"), 1.0, float("inf")], {1, 3}),  # +inf takes all the probability
    ([float("-inf")] * 4, {0}),
])
def test_rows_without_a_finite_maximum_get_the_cpu_paths_answer(row, allowed):
    x = torch.tensor([row, [0.0, 5.0, 0.0, 0.0]])
    r = _Row.of(SamplingParams(temperature=1.0), 4)
    assert race_draw(x, [1.0, 1.0], [0, 0], [1.0, 1.0], [0, 0])[0] == -1  # left to the CPU path, in one copy
    for seed in range(20):
        got = _draw_on_device(x, [r, r], [seed, seed])
        assert got[0] in allowed and got[1] in range(4)


def test_huge_and_negative_seeds_draw_and_reproduce():
    row = torch.zeros(64)
    r = _Row.of(SamplingParams(temperature=1.0), 64)
    for seed in (-1, -(2**70), 2**64 + 5, 2**63):
        a = race_draw(row.unsqueeze(0), [r.temperature], [0], [1.0], [seed])
        assert a == race_draw(row.unsqueeze(0), [r.temperature], [0], [1.0], [seed]) and 0 <= a[0] < 64
