"""Sampling: greedy is argmax, a seeded draw is reproducible and the same on every rank, and top-k /
top-p never leave their allowed set."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed import run_distributed
from lockstep.model.sampling import allowed_mask, sample
from lockstep.parallel.comm import Comm
from lockstep.steps import SamplingParams

V = 64


def logits_rows(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_whatever_top_k_and_top_p_say():
    logits = logits_rows(8, 0)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(8)]
    assert sample(logits, params, list(range(8))) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    logits = torch.zeros(1, V)  # uniform: every token equally likely
    p = [SamplingParams(temperature=1.0)]
    draws = [sample(logits, p, [s])[0] for s in range(40)]
    assert draws == [sample(logits, p, [s])[0] for s in range(40)]
    assert len(set(draws)) > 10
    big = 2**64 + 5  # seeds derived by hashing may exceed 64 bits
    assert sample(logits, p, [big]) == sample(logits, p, [big])


def test_rows_draw_independently_of_their_batch_neighbours():
    logits = logits_rows(5, 1, scale=0.5)
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 5
    seeds = [11, 22, 33, 44, 55]
    together = sample(logits, params, seeds)
    alone = [sample(logits[i: i + 1], params[i: i + 1], seeds[i: i + 1])[0] for i in range(5)]
    assert together == alone


def test_temperature_shapes_the_distribution():
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]])
    cold = [sample(logits, [SamplingParams(temperature=1.0)], [s])[0] for s in range(600)]
    hot = [sample(logits, [SamplingParams(temperature=50.0)], [s])[0] for s in range(600)]
    assert 0.68 < sum(cold) / 600 < 0.82  # p(token 1) = 0.75 at temperature 1
    assert 0.43 < sum(hot) / 600 < 0.57  # nearly uniform when hot


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), top_k=st.integers(0, V), top_p=st.floats(0.05, 1.0),
       temperature=st.floats(0.1, 3.0))
def test_top_k_and_top_p_never_pick_outside_the_allowed_set(seed, top_k, top_p, temperature):
    row = logits_rows(1, seed)[0]
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    allowed = allowed_mask(row, p)
    order = row.argsort(descending=True)
    if top_k:
        assert not allowed[order[top_k:]].any()
    probs = torch.softmax(row.masked_fill(~(allowed | _top_k(row, top_k)), -torch.inf) / temperature, -1)
    kept = probs[allowed].sum().item()
    assert kept >= min(top_p, 1.0) - 1e-5
    smallest = probs[allowed].min().item()
    assert kept - smallest < top_p + 1e-5  # nucleus is minimal: dropping its least likely token falls short
    for s in range(10):
        assert allowed[sample(row.unsqueeze(0), [p], [seed + s])[0]]


def _top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros_like(row, dtype=torch.bool)
    mask[row.argsort(descending=True)[: k or len(row)]] = True
    return mask


def test_top_k_one_is_greedy_and_a_peaked_nucleus_is_one_token():
    logits = logits_rows(6, 2)
    k1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6, list(range(6)))
    assert k1 == logits.argmax(-1).tolist()
    peaked = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    assert allowed_mask(peaked[0], SamplingParams(temperature=1.0, top_p=0.9)).tolist() == [True, False,
                                                                                          False, False]


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(temperature=-0.5), "temperature must be >= 0"),
    (SamplingParams(temperature=1.0, top_p=0.0), "top_p must be in"),
    (SamplingParams(temperature=1.0, top_p=1.5), "top_p must be in"),
    (SamplingParams(temperature=1.0, top_k=-2), "top_k must be >= 0"),
    (SamplingParams(temperature=float("nan")), "temperature must be >= 0"),
])
def test_bad_params_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        sample(logits_rows(1, 0), [params], [0])


def test_shape_mismatches_are_refused():
    with pytest.raises(ValueError, match="2 rows of logits but 1 params and 1 seeds"):
        sample(logits_rows(2, 0), [SamplingParams()], [0])
    with pytest.raises(ValueError, match=r"must be \[seqs, vocab\]"):
        sample(torch.zeros(V), [SamplingParams()], [0])


MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
         SamplingParams(temperature=1.3, top_k=5), SamplingParams(temperature=1.0)]


def sample_on_rank(comm: Comm, seeds: list[int]) -> list[int]:
    """Each rank computes its half of the vocabulary, all-gathers, then samples on its own."""
    full = logits_rows(len(MIXED), 9)
    half = V // comm.world_size
    mine = full[:, comm.rank * half: (comm.rank + 1) * half].clone()
    return sample(comm.all_gather(mine, dim=-1), MIXED, seeds)


def test_every_rank_draws_the_same_tokens():
    seeds = [101, 202, 303, 404]
    rank0, rank1 = run_distributed(sample_on_rank, 2, seeds)
    assert rank0 == rank1 == sample(logits_rows(len(MIXED), 9), MIXED, seeds)
