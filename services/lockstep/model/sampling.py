"""Pick each sequence's next token from full-vocab logits, identically on every rank.

Every rank holds the same logits (the LM head all-gathers them), so if each row's randomness comes
from a generator seeded by the engine (request seed and sample index), every rank draws the same token
without a broadcast. The draw runs on the CPU so it does not depend on the device's RNG either.

Sampling is *total*: no logits and no parameters make it raise, produce NaN or return an id outside
[0, vocab). A failure here would be a failure inside the step, which breaks a whole TP group, so every
degenerate input has a defined answer instead (see `sample`).

It is also cheap, with no sort unless top-k/top-p need one. A row takes one uniform number from its
generator and inverts the CDF of softmax((logit - max) / T): one exponential and one float64 running
sum per token, then a binary search. That is on the CPU; logits on a GPU are drawn there instead, batched
(device_sampling.py: the exponential race with hashed uniforms), never copied to the host. (On the CPU the
exponential race, argmax of logit / T + Gumbel noise, was measured too: it needs a random number and two
logarithms per token, about 3x the time, and torch's 24-bit uniforms bias the far tail, where the float64
CDF is exact to double rounding.) Top-k is a partial selection, and top-p sorts only the candidates that
can hold the nucleus.

A row's token depends only on (its logits row, its params, its seed), never on the other rows of the
batch: what is batched over rows is exactly rounded (maximum, subtraction, division, search) or runs
along each row on its own (the running sum), and the exponential runs on each row alone (it may round
differently in a vector lane than in a loop's scalar tail, so it never sees a batch layout).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.model.device_sampling import race_draw
from lockstep.steps import SamplingParams, TokenLogprobs

_SEED_MOD = 1 << 64
_F32 = torch.finfo(torch.float32)
# Temperatures are clamped into [float32's smallest normal, 1e30], where T and 1 / T are both normal
# floats (torch may divide by a scalar as a multiplication by its reciprocal): below it the draw is
# greedy anyway (ties drawn by the seed), above it every finite logit is as likely as the maximum.
_T_MIN, _T_MAX = _F32.tiny, 1e30
# Top-p without top-k first looks for the nucleus among this many of the most likely tokens; past them
# a histogram over this many levels (of scaled logit, within this span of the top) finds the tokens
# that surely cover the nucleus, and only those are sorted (a span under _BINNABLE, which float32 cannot bin, is
# sorted whole).
_FIRST_NUCLEUS, _LEVELS, _LEVELS_SPAN, _BINNABLE = 64, 512, 50.0, 1e-30
_NEG_INF = float("-inf")
# The float64 CDF a plain draw builds per pass of rows (4 MiB: 10 rows of a 49k vocabulary), in memory each thread
# keeps (`_cdf_workspace`). A CDF of the whole batch (100 MB at 256 x 49k) was new memory every step, and faulting
# it in cost twice the draw itself.
_CDF_BYTES = 1 << 22
_WORKSPACE = threading.local()


def check_params(p: SamplingParams) -> None:
    """Refuse sampling parameters that have no meaning, with the field and value named (for the API's
    edge; `sample` itself never refuses, it normalizes, see `_Row.of`)."""
    if not p.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 means off), got {p.top_k}")


@dataclass(frozen=True)
class _Row:
    """One row's parameters after normalization: temperature 0 means greedy, else it lies in
    [_T_MIN, _T_MAX]; top_k 0 means off, else 1 < top_k < vocab; top_p 1 means off, else it is < 1."""

    temperature: float
    top_k: int
    top_p: float

    @staticmethod
    def of(p: SamplingParams, vocab: int) -> _Row:
        """Total: NaN or non-positive temperature and top_k 1 are greedy; top_k < 0 or >= vocab and NaN
        top_p or top_p >= 1 are off; top_p <= 0 keeps only the most likely token (greedy)."""
        t, k, top_p = _as(float, p.temperature, 0.0), _as(int, p.top_k, 0), _as(float, p.top_p, 1.0)
        if not t > 0 or k == 1 or top_p <= 0:
            return _Row(0.0, 0, 1.0)
        k = k if 0 < k < vocab else 0
        top_p = top_p if top_p < 1 else 1.0  # NaN compares false: off
        return _Row(min(max(t, _T_MIN), _T_MAX), k, top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1


@functools.lru_cache(maxsize=1 << 12)
def _row(p: SamplingParams, vocab: int) -> _Row:
    """`_Row.of`, cached: a step asks it for every row, and a request's rows share one params object."""
    return _Row.of(p, vocab)


def _as(cast: type, value: object, default: float) -> Any:
    """`cast(value)`, or `default` for a value of no number's meaning (None, text, an infinite top_k):
    parameters come typed from the edge, but a malformed one must not break the step either."""
    try:
        return cast(value)
    except (TypeError, ValueError, OverflowError):
        return default


@functools.lru_cache(maxsize=1 << 12)
def is_greedy(p: SamplingParams) -> bool:
    """Whether `sample` takes the argmax for these parameters (it draws no seed for them). Cached: a step asks
    it for every row, and the rows of one request share one params object (its hash is computed once)."""
    return _Row.of(p, 2).greedy


@torch.inference_mode()
def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           seeds: Sequence[int] | Callable[[int], int]) -> list[int]:
    """One token id per row: argmax at temperature 0, else a seeded draw from the filtered softmax.

    `seeds` is a seed per row, or the function of a row's index that gives it, called only for the rows that
    draw (a greedy one needs none; a step of 256 greedy rows would otherwise hash 256 seeds for nothing).

    Degenerate inputs have these answers, the same on every rank:
    - NaN logits count as -inf. A row with +inf logits draws uniformly among its +inf tokens (the
      softmax's limit). A row with no finite logit and no +inf (all -inf and/or NaN) gives token 0, which
      is also what greedy gives it.
    - Greedy (temperature 0, NaN or negative; top_k 1; top_p <= 0) is `torch.argmax` of the logits as
      they come, bit for bit; only a row whose argmax lands on a NaN is re-ranked with NaN as -inf.
    - Logits are shifted by their maximum before they are divided by T, so no temperature overflows
      them to +inf or NaN: one so small that (logit - max) / T underflows every weight but the
      maximum's is greedy, ties drawn by the seed; an infinite one is uniform over the finite logits.
    - top_k < 0 or >= vocab is off; top_p NaN or >= 1 is off; a tiny top_p keeps one token.
    - fp16/bf16 logits are widened to float32 (exactly) before any arithmetic.
    Only a caller's mismatch of shapes is refused (a bug, never request content).
    """
    n, vocab = _shape(logits)
    seed_of = _seed_function(seeds, n, len(params))
    rows = [_row(p, vocab) for p in params]
    out = [0] * n
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        for i, token in zip(greedy, _argmax(logits if len(greedy) == n else logits[greedy]), strict=True):
            out[i] = token
    drawn = [i for i, r in enumerate(rows) if not r.greedy]
    if drawn:
        x = logits if len(drawn) == n else logits[drawn]
        draw = _draw if x.device.type == "cpu" else _draw_on_device
        tokens = draw(x, [rows[i] for i in drawn], [int(seed_of(i)) for i in drawn])
        for i, token in zip(drawn, tokens, strict=True):
            out[i] = token
    return out


def _shape(logits: torch.Tensor) -> tuple[int, int]:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [seqs, vocab], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary")
    return n, vocab


def _seed_function(seeds: Sequence[int] | Callable[[int], int], n: int, n_params: int) -> Callable[[int], int]:
    """A row's seed by its index, whichever way `sample` was given them; a count that does not match is a bug."""
    n_seeds = n if callable(seeds) else len(seeds)
    if not n_params == n_seeds == n:
        raise ValueError(f"{n} rows of logits but {n_params} params and {n_seeds} seeds")
    return seeds if callable(seeds) else seeds.__getitem__


def _draw_on_device(x: torch.Tensor, rows: list[_Row], seeds: list[int]) -> list[int]:
    """Seeded draws for rows on an accelerator, where they are (device_sampling.py); a row with no finite
    maximum (NaN, +inf, no finite logit) goes to the CPU path, which has an answer for each of those."""
    out = race_draw(x, [r.temperature for r in rows], [r.top_k for r in rows], [r.top_p for r in rows], seeds)
    odd = [j for j, token in enumerate(out) if token < 0]
    if odd:
        for j, token in zip(odd, _draw(x[odd], [rows[j] for j in odd], [seeds[j] for j in odd]), strict=True):
            out[j] = token
    return out


def _draw(x: torch.Tensor, rows: list[_Row], seeds: list[int]) -> list[int]:
    """Seeded draws on the CPU: rows with no top-k/top-p together, the others one by one."""
    x = x.to("cpu", torch.float32)
    out = [0] * len(rows)
    plain = [j for j, r in enumerate(rows) if not r.filtered]
    if plain:
        picked = _cdf_draw(x if len(plain) == len(rows) else x[plain],
                           [rows[j].temperature for j in plain], [seeds[j] for j in plain])
        for j, token in zip(plain, picked, strict=True):
            out[j] = token
    for j, r in enumerate(rows):
        if r.filtered:
            out[j] = _draw_filtered(x[j], r, seeds[j])
    return out


def _argmax(logits: torch.Tensor) -> list[int]:
    """Greedy ids, as `torch.argmax` gives them (so greedy never changes); a row whose maximum is NaN
    (argmax propagates NaN) or -inf is ranked again with NaN as -inf."""
    ids = torch.argmax(logits, dim=-1)
    out = ids.tolist()
    usable = logits.gather(1, ids.unsqueeze(1)).squeeze(1) > _NEG_INF  # False for NaN and -inf
    if not bool(usable.all()):
        for r in torch.nonzero(~usable).flatten().tolist():
            out[r] = int(torch.argmax(_sanitized(logits[r])))
    return out


def _sanitized(row: torch.Tensor) -> torch.Tensor:
    """A 1-D row with NaN as -inf and, where the row has +inf logits, only those left (as 0): the
    softmax's limit puts all the probability on them, equally."""
    row = torch.where(torch.isnan(row), _NEG_INF, row)
    top = row == float("inf")
    if bool(top.any()):
        row = torch.zeros_like(row).masked_fill_(~top, _NEG_INF)
    return row


def _prepared(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the sanitized row, its maximum), or None when no logit is finite or +inf (the draw is token 0).
    A row whose maximum is finite has no NaN and no +inf (max propagates both): it is used as it is."""
    top = row.max()
    if not bool(torch.isfinite(top)):
        row = _sanitized(row)
        top = row.max()
        if not bool(torch.isfinite(top)):
            return None
    return row, top


def _uniform(seed: int) -> torch.Tensor:
    """This row's one random number, in [0, 1 - 2^-53], from its own seeded CPU generator."""
    gen = torch.Generator(device="cpu").manual_seed(seed % _SEED_MOD)
    return torch.empty(1, dtype=torch.float64).uniform_(generator=gen)


def _pick(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over the last dim: the first id whose cumulative weight exceeds u * total. With
    u < 1 and a total >= 1 the target stays below the total, so the id is in range, and its cumulative
    weight rose there, so its weight is positive: a -inf (or underflowed) logit is never drawn."""
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True)


def _cdf_draw(x: torch.Tensor, temperatures: list[float], seeds: list[int]) -> list[int]:
    """Batched draws for rows with no top-k/top-p, from softmax((x - max) / T) by its CDF. Shifting by
    the maximum keeps the weights exp((x - max) / T) within [0, 1] with the top at exactly 1 (no
    overflow, however small T); a row whose maximum is not finite (NaN, +inf, all -inf) is drawn again
    on its own, sanitized."""
    t = torch.tensor(temperatures, dtype=torch.float32).unsqueeze(1)
    top = torch.amax(x, dim=1, keepdim=True)  # NaN if the row has a NaN
    u = torch.cat([_uniform(seed) for seed in seeds]).unsqueeze(1)
    out: list[int] = []
    space, cdfs = _cdf_workspace(x.shape[1])
    rows = space.shape[0]
    for a in range(0, x.shape[0], rows):  # a few rows a pass, in memory kept from the last step
        k = min(rows, x.shape[0] - a)
        weights = torch.sub(x[a:a + k], top[a:a + k], out=space[:k]).div_(t[a:a + k])
        for w, c in zip(weights, cdfs[:k], strict=True):  # row by row: the exponential never sees a batch layout
            torch.cumsum(w.exp_(), 0, dtype=torch.float64, out=c)
        out += _pick(cdfs[:k], u[a:a + k]).squeeze(1).tolist()
    for r in torch.nonzero(~torch.isfinite(top.squeeze(1))).flatten().tolist():
        out[r] = _draw_sanitized(x[r], temperatures[r], seeds[r])
    return out


def _cdf_workspace(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's float32 weights and float64 CDF for a plain draw's pass of rows over `vocab`, kept across
    steps: new memory of that size every step is faulted in page by page, which cost more than the draw."""
    made = getattr(_WORKSPACE, "cdf", None)
    if made is None or made[0].shape[1] != vocab:
        rows = max(1, _CDF_BYTES // (8 * vocab))
        made = _WORKSPACE.cdf = (torch.empty(rows, vocab, dtype=torch.float32),
                                 torch.empty(rows, vocab, dtype=torch.float64))
    return made


def _draw_sanitized(row: torch.Tensor, temperature: float, seed: int) -> int:
    """One row's draw on the sanitized logits; no finite logit at all gives token 0."""
    prepared = _prepared(row)
    if prepared is None:
        return 0
    row, top = prepared
    cdf = torch.cumsum(torch.exp((row - top) / temperature), 0, dtype=torch.float64)
    return int(_pick(cdf, _uniform(seed)))


def _draw_filtered(row: torch.Tensor, p: _Row, seed: int) -> int:
    """A draw restricted to the top-k tokens, then to the nucleus of top_p (probabilities at this
    temperature, over the top-k tokens when top_k is set, else over the whole row)."""
    prepared = _prepared(row)
    if prepared is None:
        return 0
    ids, weights = _allowed(*prepared, p)
    cdf = torch.cumsum(weights, 0, dtype=torch.float64)  # most likely first: starts at 1
    return int(ids[_pick(cdf, _uniform(seed))])


def _allowed(row: torch.Tensor, top: torch.Tensor, p: _Row) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights exp((logit - max) / T)) of the tokens a filtered row may draw, most likely first,
    ties by id. Sums run in float64 and in order, so they come out the same on any thread count."""
    if p.top_k:
        ids = _top_ids(row, p.top_k)
        weights = torch.exp((row[ids] - top) / p.temperature)
        if p.top_p < 1:
            keep, _ = _nucleus(weights, None, p.top_p)
            ids, weights = ids[:keep], weights[:keep]
        return ids, weights
    scaled = (row - top) / p.temperature
    weights = torch.exp(scaled)
    total = float(torch.cumsum(weights, 0, dtype=torch.float64)[-1])
    ids = _top_ids(row, min(_FIRST_NUCLEUS, row.numel()))
    keep, closed = _nucleus(weights[ids], total, p.top_p)
    if not closed:  # a wide nucleus: sort only what surely covers it
        ids = _covering(row, scaled, weights, total * p.top_p)
        keep, closed = _nucleus(weights[ids], total, p.top_p)
        if not closed:  # rounding left it short: sort everything
            ids = _top_ids(row, row.numel())
            keep, _ = _nucleus(weights[ids], total, p.top_p)
    return ids[:keep], weights[ids[:keep]]


def _covering(row: torch.Tensor, scaled: torch.Tensor, weights: torch.Tensor, need: float) -> torch.Tensor:
    """The tokens whose scaled logit is at least a level whose weight reaches `need`, in stable
    descending order: a superset of the nucleus found by one weighted histogram instead of a sort of
    the row (tokens below e^-50 of the total are never needed). If none is enough, every token."""
    least = float(scaled.min())
    if least == _NEG_INF:  # the least finite one
        least = float(torch.where(torch.isinf(scaled), 0.0, scaled).min())
    lo = max(least, math.log(need) - _LEVELS_SPAN)
    level = 0.0  # every finite token ties with the maximum: they are the cover
    if -_BINNABLE < lo < 0:  # a spread this small cannot be binned in float32 (512 / -lo overflows): sort it all
        return _top_ids(row, row.numel())
    if lo < 0:
        mass = _histogram(scaled, weights, lo)
        short = int((torch.cumsum(mass.flip(0), 0, dtype=torch.float64) < need).sum())  # top bins short
        if short >= _LEVELS:
            return _top_ids(row, row.numel())
        level = lo + (0.0 - lo) * max(0, _LEVELS - 2 - short) / _LEVELS  # a bin lower, against rounding
    ids = torch.nonzero(scaled >= level).flatten()  # ascending ids within equal values
    return ids[torch.sort(row[ids], descending=True, stable=True).indices]


def _histogram(scaled: torch.Tensor, weights: torch.Tensor, lo: float) -> torch.Tensor:
    """The weight of the tokens in each of _LEVELS equal bins of [lo, 0] (`torch.histogram`'s bins, the top one
    closed), by one bincount: a third of torch.histogram's time. A token in the wrong bin by rounding costs
    nothing but speed: `_covering` keeps a bin to spare, and `_nucleus` checks that the cover is enough."""
    at = (scaled - lo).mul_(_LEVELS / (0.0 - lo)).floor_().clamp_(min=-1, max=_LEVELS - 1).long()
    return torch.bincount(at.add_(1), weights=weights, minlength=_LEVELS + 1)[1:]


def _top_ids(row: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of a NaN-free row, ordered as a stable descending sort would (ties by id), without
    sorting the row: a partial selection of k + 1 tells whether ties straddle the cut."""
    if k >= row.numel():
        return torch.sort(row, descending=True, stable=True).indices
    values, ids = torch.topk(row, k + 1)
    kth = values[k - 1]
    ids = ids[:k]
    if bool(values[k] == kth):  # tokens tied with the k-th straddle the cut: take the lowest ids
        above = torch.nonzero(row > kth).flatten()
        ids = torch.cat([above, torch.nonzero(row == kth).flatten()[: k - above.numel()]])
    ids = torch.sort(ids).values  # ascending ids within equal values
    return ids[torch.sort(row[ids], descending=True, stable=True).indices]


def _nucleus(weights: torch.Tensor, total: float | None, top_p: float) -> tuple[int, bool]:
    """How many of these candidates (most likely first) make the nucleus: the smallest prefix whose
    share of `total` (theirs when None) reaches top_p, at least one token; and whether they reach it
    at all (if not, the nucleus may go on past them). The running sum is float64 and in order."""
    cum = torch.cumsum(weights, 0, dtype=torch.float64)
    before = cum.roll(1)  # the weight of the tokens ahead of each one
    before[0] = 0.0
    need = top_p * (float(cum[-1]) if total is None else total)
    return max(1, int((before < need).sum())), bool(cum[-1] >= need)


def allowed_mask(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens `sample` may return for this row and these params, as a boolean mask: the argmax when
    greedy, else the top-k tokens and then the nucleus of top_p (ties broken by token id)."""
    rows = logits.unsqueeze(0)
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
    r = _Row.of(p, logits.shape[-1])
    if r.greedy:
        mask[_argmax(rows)[0]] = True
        return mask
    prepared = _prepared(logits.to("cpu", torch.float32))
    if prepared is None:
        mask[0] = True
    elif r.filtered:
        mask[_allowed(*prepared, r)[0]] = True
    else:
        mask |= prepared[0] > _NEG_INF
    return mask


@torch.inference_mode()
def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int], ranks: bool = False
                   ) -> list[TokenLogprobs]:
    """Per row: the log-probability of `token_ids[row]` and the `ks[row]` most likely tokens, most likely
    first, under log_softmax of the raw logits in float32: before temperature, top-k and
    top-p (vLLM's default `logprobs_mode=raw_logprobs`), so a token's logprob does not depend on how it
    was drawn. Every rank holds the same logits, so every rank computes the same answer. NaN logits stay
    NaN here; the API clamps what JSON cannot carry. `ranks`: each token's rank too (1 + how many tokens are
    more likely), which vLLM's prompt_logprobs show."""
    if logits.dim() != 2 or not logits.shape[0] == len(token_ids) == len(ks):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(token_ids)} tokens and {len(ks)} counts")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, torch.tensor(list(token_ids), device=lp.device).unsqueeze(1))
    rank = ((lp > chosen_t).sum(dim=1) + 1).tolist() if ranks else [0] * len(token_ids)
    chosen = chosen_t.squeeze(1).tolist()
    k = min(max(ks, default=0), lp.shape[1])
    top_lp, top_ids = torch.topk(lp, k, dim=-1, sorted=True)
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(c, tuple(zip(ids[:n], vals[:n], strict=True)), r)
            for c, ids, vals, n, r in zip(chosen, top_ids, top_lp, ks, rank, strict=True)]
