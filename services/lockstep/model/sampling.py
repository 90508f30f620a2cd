"""Pick each sequence's next token from full-vocab logits, identically on every rank.

Every rank holds the same logits (the LM head all-gathers them), so if each row's randomness comes
from a generator seeded by the engine (request seed and sample index), every rank draws the same token
without a broadcast. The draw runs on the CPU so it does not depend on the device's RNG either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep.steps import SamplingParams

_SEED_MOD = 1 << 64


def check_params(p: SamplingParams) -> None:
    """Refuse sampling parameters that have no meaning, with the field and value named."""
    if not p.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 means off), got {p.top_k}")


def allowed_mask(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tokens a row may draw after top-k and then top-p: the k highest, then the smallest set of those
    whose probability (at this temperature) reaches top_p. Ties are broken by token id."""
    v = logits.shape[-1]
    order = torch.sort(logits, descending=True, stable=True).indices
    keep = torch.ones(v, dtype=torch.bool)
    if 0 < p.top_k < v:
        keep[p.top_k:] = False
    if p.top_p < 1:
        sorted_logits = logits[order].masked_fill(~keep, float("-inf"))
        probs = torch.softmax(sorted_logits / p.temperature, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        keep &= before < p.top_p
        keep[0] = True
    mask = torch.zeros(v, dtype=torch.bool)
    mask[order[keep]] = True
    return mask


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int]) -> list[int]:
    """One token id per row: argmax at temperature 0, else a seeded draw from the filtered softmax."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [seqs, vocab], got shape {tuple(logits.shape)}")
    if not len(params) == len(seeds) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(params)} params and {len(seeds)} seeds")
    for p in params:
        check_params(p)
    out = torch.argmax(logits, dim=-1).tolist()
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if not drawn:
        return out
    rows = logits[drawn].float().cpu()
    for row, i in zip(rows, drawn, strict=True):
        p = params[i]
        masked = row.masked_fill(~allowed_mask(row, p), float("-inf"))
        probs = torch.softmax(masked / p.temperature, dim=-1)
        gen = torch.Generator(device="cpu").manual_seed(int(seeds[i]) % _SEED_MOD)
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
