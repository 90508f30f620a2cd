"""Sampling: greedy is argmax, a seeded draw is reproducible, the same on every rank and independent of
its batch neighbours, top-k / top-p never leave their allowed set, and no input at all makes it raise,
return NaN's token or an id outside the vocabulary (a failure there would break a whole TP group)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distributed import run_distributed
from lockstep.model.sampling import allowed_mask, check_params, is_greedy, sample, token_logprobs
from lockstep.parallel.comm import Comm
from lockstep.steps import SamplingParams

V = 64
INF, NAN = math.inf, math.nan


def logits_rows(n: int, seed: int, scale: float = 3.0, vocab: int = V) -> torch.Tensor:
    return scale * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


def draws(logits: torch.Tensor, p: SamplingParams, n: int = 200) -> list[int]:
    """One row's token under n seeds."""
    return [sample(logits, [p], [s])[0] for s in range(n)]


# ---- greedy ----------------------------------------------------------------------------------------

def test_greedy_is_argmax_whatever_top_k_and_top_p_say():
    logits = logits_rows(8, 0)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(8)]
    assert sample(logits, params, list(range(8))) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_bit_identical_to_torch_argmax(dtype):
    """What greedy returned before the rewrite: torch.argmax of the logits as they come, ties included."""
    logits = torch.cat([logits_rows(6, 3), torch.zeros(1, V), torch.full((1, V), 7.0),
                        torch.tensor([[1.0, INF, 2.0, INF] + [0.0] * (V - 4)])]).to(dtype)
    expected = torch.argmax(logits, dim=-1).tolist()
    assert sample(logits, [SamplingParams()] * len(logits), [0] * len(logits)) == expected
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(len(logits))]
    got = sample(logits, mixed, list(range(len(logits))))
    assert [t for i, t in enumerate(got) if i % 2] == [t for i, t in enumerate(expected) if i % 2]


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.0), SamplingParams(temperature=-1.0),
                               SamplingParams(temperature=NAN), SamplingParams(temperature=2.0, top_k=1),
                               SamplingParams(temperature=2.0, top_p=0.0),
                               SamplingParams(temperature=2.0, top_p=-3.0)])
def test_every_greedy_spelling_is_argmax_with_nan_as_minus_infinity(p):
    row = torch.tensor([[NAN, 1.0, 5.0, NAN, 5.0, -INF]])
    assert draws(row, p, 20) == [2] * 20


# ---- seeded draws ----------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    logits = torch.zeros(1, V)  # uniform: every token equally likely
    p = SamplingParams(temperature=1.0)
    first = draws(logits, p, 40)
    assert first == draws(logits, p, 40)
    assert len(set(first)) > 10
    big = 2**64 + 5  # seeds derived by hashing may exceed 64 bits
    assert sample(logits, [p], [big]) == sample(logits, [p], [big])
    assert sample(logits, [p], [-7]) == sample(logits, [p], [-7])


def test_seeds_given_as_a_function_are_asked_for_the_drawing_rows_only_and_draw_the_same_tokens():
    """The engine passes its per-draw seeds as a function of the row, so a greedy row costs no seed hash."""
    logits = logits_rows(4, seed=3)
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(top_k=1, temperature=1.0),
              SamplingParams(temperature=1.2, top_p=0.9)]
    seeds = [11, 22, 33, 44]
    asked: list[int] = []

    def seed_of(i: int) -> int:
        asked.append(i)
        return seeds[i]

    assert sample(logits, params, seed_of) == sample(logits, params, seeds)
    assert asked == [1, 3]
    assert [is_greedy(p) for p in params] == [True, False, True, False]


def test_pinned_draws():
    """Pins the seeded draws: a change here changes the tokens that every replay and recompute draws
    (and that ranks of mixed versions would disagree on), so it must be deliberate."""
    row = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0, 3.0, 2.5, 0.0]])
    assert draws(row, SamplingParams(temperature=1.0), 16) == [6, 1, 6, 1, 5, 5, 5, 4, 6, 3, 5, 2, 6, 6, 5, 5]
    assert draws(row, SamplingParams(temperature=0.7, top_k=3, top_p=0.8), 8) == [6, 5, 6, 5, 5, 5, 5, 5]


def test_rows_draw_independently_of_their_batch_neighbours():
    logits = logits_rows(5, 1, scale=0.5)
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 5
    seeds = [11, 22, 33, 44, 55]
    together = sample(logits, params, seeds)
    alone = [sample(logits[i: i + 1], params[i: i + 1], seeds[i: i + 1])[0] for i in range(5)]
    assert together == alone


MODES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
         SamplingParams(temperature=1.3, top_k=50), SamplingParams(temperature=1.0, top_k=40, top_p=0.8),
         SamplingParams(temperature=0.0), SamplingParams(temperature=1e-30)]


@pytest.mark.parametrize("vocab", [49152, 50257])  # the built-in model's, and an odd one (GPT-2's)
def test_a_row_draws_the_same_token_alone_among_31_different_neighbours_and_on_any_thread_count(vocab):
    """The cross-rank and replay requirement: a row's token depends on its logits, params and seed only,
    at real vocabulary widths (where rows span several vector and thread chunks)."""
    before = torch.get_num_threads()
    logits = logits_rows(32, 5, scale=2.0, vocab=vocab)
    logits[7, ::3] = -INF
    logits[9, 100] = NAN
    logits[11] *= 1e30  # (logit - max) / T overflows to -inf for all but the top
    params = [MODES[(i * 5) % len(MODES)] for i in range(32)]
    seeds = [1000 + 17 * i for i in range(32)]
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batch = sample(logits, params, seeds)
            for i in range(0, 32, 3):
                assert sample(logits[i: i + 1], params[i: i + 1], seeds[i: i + 1]) == [batch[i]]
            shuffled = torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()
            again = sample(logits[shuffled], [params[i] for i in shuffled], [seeds[i] for i in shuffled])
            assert again == [batch[i] for i in shuffled]
            results.append(batch)
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1]


def test_plain_draws_in_several_passes_are_the_whole_batch_cdf_draws_row_by_row():
    """A plain batch wider than one pass of the kept memory (`_CDF_BYTES`: 10 rows at 49k) draws what one CDF of
    the whole batch drew (the rule before the passes, written out here), and what each row draws alone; a
    vocabulary of another width in between does not disturb it."""
    from lockstep.model import sampling

    n, vocab = 27, 49152
    logits = logits_rows(n, 9, scale=2.0, vocab=vocab)
    temperatures = [0.5 + 0.1 * (i % 7) for i in range(n)]
    seeds = [7 * i + 3 for i in range(n)]
    weights = (logits - logits.amax(1, keepdim=True)).div_(torch.tensor(temperatures).unsqueeze(1))
    cdf = torch.stack([torch.cumsum(w.exp(), 0, dtype=torch.float64) for w in weights])
    u = torch.cat([sampling._uniform(s) for s in seeds]).unsqueeze(1)
    whole = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).tolist()
    params = [SamplingParams(temperature=t) for t in temperatures]
    assert sampling._cdf_workspace(vocab)[1].shape[0] < n  # so the batch takes several passes
    assert sample(logits, params, seeds) == whole
    sample(logits_rows(3, 1, vocab=V), params[:3], seeds[:3])
    assert sample(logits, params, seeds) == whole
    assert [sample(logits[i:i + 1], params[i:i + 1], seeds[i:i + 1])[0] for i in range(n)] == whole


# ---- the distribution ------------------------------------------------------------------------------

def frequencies(tokens: list[int], vocab: int) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(vocab)]


def test_the_draw_follows_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    row = torch.log(probs).unsqueeze(0)
    seen = frequencies(draws(row, SamplingParams(temperature=1.0), 4000), 6)
    for got, want in zip(seen, probs.tolist(), strict=True):
        assert abs(got - want) < 0.03
    assert seen[5] == 0.0  # probability 0 (-inf) is never drawn


def test_top_k_and_top_p_renormalize_what_they_keep():
    row = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    top2 = frequencies(draws(row, SamplingParams(temperature=1.0, top_k=2), 3000), 4)
    assert abs(top2[0] - 4 / 7) < 0.035 and top2[2] == top2[3] == 0.0
    nucleus = frequencies(draws(row, SamplingParams(temperature=1.0, top_p=0.75), 3000), 4)
    assert abs(nucleus[0] - 4 / 9) < 0.035 and nucleus[3] == 0.0


def test_temperature_shapes_the_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    cold = draws(logits, SamplingParams(temperature=1.0), 600)
    hot = draws(logits, SamplingParams(temperature=50.0), 600)
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
    if top_k > 1:
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


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_a_wide_nucleus_is_the_one_a_full_sort_gives(top_p):
    """Past its first 64 candidates top-p covers the nucleus by a histogram instead of sorting the row;
    the set must still be the sorted prefix that first reaches top_p."""
    row = logits_rows(1, 4, scale=0.3, vocab=4096)[0]  # flat: the nucleus holds thousands of tokens
    allowed = allowed_mask(row, SamplingParams(temperature=1.0, top_p=top_p))
    order = torch.sort(row, descending=True, stable=True).indices
    probs = torch.softmax(row, 0)[order]
    count = int(allowed.sum())
    assert count > 64 and bool(allowed[order[:count]].all())
    assert probs[: count - 1].sum().item() < top_p <= probs[:count].sum().item() + 1e-5


def test_the_covering_histogram_bins_as_torch_histogram_does():
    """`_covering`'s bincount puts each token where torch.histogram's bins over [lo, 0] would (the top one
    closed; below lo and -inf nowhere): a token binned wrong would make the cover looser or the check fall back
    to a full sort."""
    from lockstep.model import sampling

    row = logits_rows(1, 6, scale=3.0, vocab=49152)[0]
    row[::97] = -INF
    scaled = row - row.max()
    weights = torch.exp(scaled)
    lo = float(scaled[1]) - 1e-3
    scaled[5] = lo
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch.histogram sums a bin's weights in another order on more threads; ours does not
    try:
        for bottom in (lo, -30.0, -0.5):
            expected = torch.histogram(scaled, bins=sampling._LEVELS, range=(bottom, 0.0), weight=weights).hist
            assert torch.equal(sampling._histogram(scaled, weights, bottom), expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("row", [
    [-1e-40] + [0.0] * 99,  # every finite logit within a denormal of the top
    [0.0, -1e-6] * 50,
])
def test_a_top_p_row_whose_logits_all_but_tie_draws_instead_of_raising(row):
    """The covering histogram's bins over [lo, 0] with lo ~ -1e-40: the scale 512 / -lo overflows float32 (it
    raised in bincount), and such a row must still draw from its nucleus (from a helper's fuzz)."""
    logits = torch.tensor([row])
    for p in (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1e30, top_p=0.9)):
        allowed = allowed_mask(logits[0], p)
        assert int(allowed.sum()) >= 1
        assert all(allowed[t] for t in sample(logits.repeat(4, 1), [p] * 4, [1, 2, 3, 4]))


TIED = st.one_of(st.sampled_from([-INF, NAN, 0.0, 1.0, 2.5, -3.0]), st.floats(-20, 5, width=32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(TIED, min_size=65, max_size=400), top_k=st.sampled_from([0, 0, 0, 2, 50, 100, 300]),
       top_p=st.floats(0.01, 0.999), temperature=st.floats(0.05, 20.0), seed=st.integers(0, 2**40))
def test_top_k_and_top_p_over_wide_rows_are_a_prefix_of_the_stable_sort(values, top_k, top_p, temperature,
                                                                         seed):
    """Rows wider than the first 64 candidates, with ties, -inf and NaN: the allowed set is the smallest
    prefix (of the stable descending order, within the top k) whose probability reaches top_p."""
    row = torch.tensor(values)
    clean = torch.where(torch.isnan(row), -INF, row)
    if not bool(torch.isfinite(clean).any()):
        return
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    allowed = allowed_mask(row, p)
    order = torch.sort(clean, descending=True, stable=True).indices
    if 1 < top_k < len(values):
        order = order[:top_k]
    count = int(allowed.sum())
    assert 1 <= count <= len(order) and bool(allowed[order[:count]].all())
    if top_k != 1:
        probs = torch.softmax(clean[order].double() / temperature, 0)
        assert probs[:count].sum().item() >= top_p - 1e-5
        assert probs[: count - 1].sum().item() < top_p + 1e-5
    for s in range(3):
        assert allowed[sample(row.unsqueeze(0), [p], [seed + s])[0]]


def test_ties_at_the_top_k_cut_are_broken_by_token_id():
    row = torch.tensor([5.0, 1.0, 3.0, 3.0, 3.0, 0.0, 3.0])
    allowed = allowed_mask(row, SamplingParams(temperature=1.0, top_k=3))
    assert allowed.nonzero().flatten().tolist() == [0, 2, 3]
    peaked = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert allowed_mask(peaked, SamplingParams(temperature=1.0, top_p=0.9)).tolist() == [True, False,
                                                                                       False, False]


def test_top_k_one_is_greedy():
    logits = logits_rows(6, 2)
    k1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6, list(range(6)))
    assert k1 == logits.argmax(-1).tolist()


# ---- totality: degenerate inputs have answers, never errors ----------------------------------------

ALL_MODES = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
             SamplingParams(temperature=1.0, top_k=5, top_p=0.9), SamplingParams(temperature=1e-45)]


@pytest.mark.parametrize("p", ALL_MODES)
@pytest.mark.parametrize(("row", "allowed"), [
    ([-INF] * 8, {0}),  # no finite logit: token 0
    ([NAN] * 8, {0}),
    ([NAN, -INF, NAN, -INF], {0}),
    ([NAN, -INF, 2.0, NAN], {2}),  # NaN counts as -inf: the one finite token
    ([1.0, INF, 3.0, INF, NAN], {1, 3}),  # +inf: uniform over the +inf tokens
    ([3e38, -3e38, 3e38, 0.0], {0, 2}),
])
def test_degenerate_rows_have_a_defined_answer(p, row, allowed):
    got = set(draws(torch.tensor([row]), p, 40))
    assert got <= allowed
    if p.temperature == 1.0 and not p.top_k and p.top_p == 1.0:
        assert got == allowed  # ties at the top are drawn by the seed, each one sometimes


@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 5e-324, 1e-38])
def test_a_vanishing_temperature_is_greedy(temperature):
    """logits / T overflows to inf here; the draw shifts by the maximum first, so it is the argmax."""
    logits = logits_rows(4, 6, scale=50.0)
    for p in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_p=0.9),
              SamplingParams(temperature=temperature, top_k=10)):
        assert sample(logits, [p] * 4, [1, 2, 3, 4]) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e30, 1e300, INF])
def test_an_infinite_temperature_is_uniform_over_the_finite_logits(temperature):
    row = torch.tensor([[100.0, -100.0, NAN, 0.0, -INF, 1e20]])
    assert set(draws(row, SamplingParams(temperature=temperature), 200)) == {0, 1, 3, 5}


def test_extreme_temperatures_hold_with_denormals_flushed_to_zero():
    """Some processes flush denormals (torch.set_flush_denormal): 1 / T must stay a normal float."""
    row = torch.tensor([[100.0, -100.0, NAN, 0.0, -INF, 1e20, 3e38]])
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for t in (1e-45, 1e-38, 1e30, 3.4e38, INF):
            for p in (SamplingParams(temperature=t), SamplingParams(temperature=t, top_k=3),
                      SamplingParams(temperature=t, top_p=0.5)):
                got = set(draws(row, p, 30))
                assert got and got <= {0, 1, 3, 5, 6}
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize(("odd", "same_as"), [
    (SamplingParams(temperature=1.0, top_p=1.5), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_p=NAN), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_k=-2), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_k=10**9), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_k=V), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_p=1e-12), SamplingParams(temperature=0.0)),
])
def test_out_of_range_params_are_normalized_not_refused(odd, same_as):
    logits = logits_rows(1, 8)
    assert draws(logits, odd, 30) == draws(logits, same_as, 30)


@pytest.mark.parametrize(("odd", "same_as"), [  # deliberately ill-typed
    (SamplingParams(temperature=None), SamplingParams(temperature=0.0)),
    (SamplingParams(temperature="hot"), SamplingParams(temperature=0.0)),
    (SamplingParams(temperature=1.0, top_k=INF), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_k=NAN), SamplingParams(temperature=1.0)),
    (SamplingParams(temperature=1.0, top_p=None), SamplingParams(temperature=1.0)),
])
def test_malformed_params_fall_back_instead_of_raising(odd, same_as):
    logits = logits_rows(1, 8)
    assert draws(logits, odd, 20) == draws(logits, same_as, 20)


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(temperature=-0.5), "temperature must be >= 0"),
    (SamplingParams(temperature=1.0, top_p=0.0), "top_p must be in"),
    (SamplingParams(temperature=1.0, top_p=1.5), "top_p must be in"),
    (SamplingParams(temperature=1.0, top_k=-2), "top_k must be >= 0"),
    (SamplingParams(temperature=float("nan")), "temperature must be >= 0"),
])
def test_check_params_refuses_what_has_no_meaning_at_the_edge(params, message):
    with pytest.raises(ValueError, match=message):
        check_params(params)


def test_shape_mismatches_are_refused_and_an_empty_batch_is_empty():
    with pytest.raises(ValueError, match="2 rows of logits but 1 params and 1 seeds"):
        sample(logits_rows(2, 0), [SamplingParams()], [0])
    with pytest.raises(ValueError, match=r"must be \[seqs, vocab\]"):
        sample(torch.zeros(V), [SamplingParams()], [0])
    assert sample(torch.zeros(0, V), [], []) == []


WEIRD = st.sampled_from([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45, 65504.0, 1e5])
VALUES = st.one_of(WEIRD, st.floats(width=32, allow_nan=True, allow_infinity=True),
                   st.floats(-30, 30, width=32))
TEMPERATURES = st.one_of(st.sampled_from([0.0, -1.0, NAN, INF, 1e-45, 1e-30, 5e-324, 1e-38, 2.0, 1e300]),
                         st.floats(0.01, 10.0))
TOP_PS = st.one_of(st.sampled_from([NAN, -1.0, 0.0, 1e-12, 1.0, 2.0, INF]), st.floats(0.0, 1.0))


@st.composite
def weird_batches(draw) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    vocab = draw(st.integers(1, 24))
    rows = draw(st.integers(1, 4))
    values = draw(st.lists(st.lists(VALUES, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    params = [SamplingParams(temperature=draw(TEMPERATURES), top_k=draw(st.integers(-3, vocab + 3)),
                             top_p=draw(TOP_PS)) for _ in range(rows)]
    seeds = draw(st.lists(st.integers(-(2**70), 2**70), min_size=rows, max_size=rows))
    return torch.tensor(values, dtype=torch.float32).to(dtype), params, seeds


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=weird_batches())
def test_sampling_is_total_deterministic_and_row_local(batch):
    """Any logits (NaN, +-inf, extremes, half precision) and any params: a valid id per row, from the
    allowed set, never a NaN or -inf token while a better one exists; the same again for the same
    inputs, and the same for a row alone as in its batch."""
    logits, params, seeds = batch
    vocab = logits.shape[1]
    got = sample(logits, params, seeds)
    assert len(got) == len(params) and all(isinstance(t, int) and 0 <= t < vocab for t in got)
    assert sample(logits.clone(), list(params), list(seeds)) == got
    for i, (row, p, s) in enumerate(zip(logits, params, seeds, strict=True)):
        assert sample(row.unsqueeze(0), [p], [s]) == [got[i]]
        assert allowed_mask(row, p)[got[i]]
        wide = row.float()
        usable = ~torch.isnan(wide) & (wide > -INF)
        if usable.any():
            assert usable[got[i]]
        if (wide == INF).any():
            assert wide[got[i]] == INF


# ---- ranks -----------------------------------------------------------------------------------------

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


# ---- logprobs ----------------------------------------------------------------------------------------

def test_token_logprobs_are_the_raw_log_softmax_and_its_k_largest():
    logits = logits_rows(3, 11).to(torch.bfloat16)
    chosen = [5, 0, 63]
    got = token_logprobs(logits, chosen, [0, 4, V + 10])  # k past the vocabulary: all of it
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert [g.logprob for g in got] == pytest.approx([ref[i, t].item() for i, t in enumerate(chosen)], abs=1e-6)
    assert got[0].top == ()
    assert [i for i, _ in got[1].top] == ref[1].topk(4).indices.tolist()
    assert [v for _, v in got[1].top] == pytest.approx(ref[1].topk(4).values.tolist(), abs=1e-6)
    assert len(got[2].top) == V and sorted((v for _, v in got[2].top), reverse=True) == [v for _, v in got[2].top]


def test_token_logprobs_do_not_depend_on_how_the_token_was_drawn():
    """vLLM's default logprobs_mode (raw_logprobs): the model's distribution, before temperature and top-k/p."""
    logits = logits_rows(1, 12)
    hot = sample(logits, [SamplingParams(temperature=1.7, top_k=5, top_p=0.5)], [3])[0]
    assert token_logprobs(logits, [hot], [2])[0].logprob == pytest.approx(
        torch.log_softmax(logits, -1)[0, hot].item(), abs=1e-6)


def test_token_logprobs_of_degenerate_rows_never_raise():
    logits = torch.tensor([[-INF] * 4, [NAN, 0.0, 1.0, 2.0], [INF, 0.0, 0.0, 0.0]])
    got = token_logprobs(logits, [0, 3, 0], [2, 2, 2])
    assert len(got) == 3 and all(len(g.top) == 2 for g in got)
    with pytest.raises(ValueError, match="for 1 tokens"):
        token_logprobs(logits, [0], [1])
