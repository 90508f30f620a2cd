"""vLLM's logit adjustments before sampling: logit_bias, min_tokens, then the repetition, frequency and presence
penalties, batched over the rows that ask for any, in float32.

The order and arithmetic are vLLM's (v1 sampler): the logits are widened to float32; `logit_bias` is added and
`min_tokens` sets the stop ids to -inf (its "non-argmax-invariant" logits processors); then `apply_penalties`:
a token in the prompt or the output has its logit divided by the repetition penalty r when > 0, else multiplied
by r (vLLM's CUDA kernel, and transformers' RepetitionPenaltyLogitsProcessor); then `logit -= f * count` and
`logit -= p * (count > 0)` over the output's tokens (OpenAI's definition). Temperature, top-k and top-p come after,
in sampling.py; logprobs stay of the raw logits.

Every rank holds the same logits and the same `TokenCounts` (built from what the plans carry), so every rank
computes the same adjusted logits. Like sampling, this is *total*: no parameter and no logit makes it raise or
create a NaN (a NaN logit stays NaN, which sampling reads as -inf), since a failure here breaks a TP group.
Parameters outside the API's ranges are normalized (`RowPenalty.of`), not refused.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lockstep.steps import Chunk, SamplingParams

log = logging.getLogger("lockstep.penalties")

_F32 = torch.finfo(torch.float32)
_BIAS_MAX = 100.0  # vLLM clamps logit_bias into [-100, 100]; the API refuses beyond it
_PENALTY_MAX = 1e6  # |f| and |p| beyond any valid value, small enough that f * count stays finite in float32


@dataclass
class TokenCounts:
    """What one rank knows of a penalized request's tokens: those of the prompt (as a set) and the output's
    counts. `length` is how many positions it has seen, of which the first `prompt_len` are the prompt's."""

    prompt_len: int
    length: int = 0
    prompt: set[int] = field(default_factory=set)
    output: Counter[int] = field(default_factory=Counter)

    @classmethod
    def of(cls, tokens: Sequence[int], prompt_len: int) -> TokenCounts:
        """The counts of a request whose tokens (prompt, then output) are `tokens`."""
        prompt_len = min(max(prompt_len, 0), len(tokens))
        return cls(prompt_len, len(tokens), set(tokens[:prompt_len]), Counter(tokens[prompt_len:]))

    def extend(self, start: int, tokens: Sequence[int]) -> None:
        """Take in the tokens at positions [start, start + len(tokens)); positions already seen are skipped."""
        for position, token in enumerate(tokens, start):
            if position < self.length:
                continue
            if position < self.prompt_len:
                self.prompt.add(token)
            else:
                self.output[token] += 1
            self.length = position + 1


class PenaltyBook:
    """The token counts a rank keeps for its penalized requests: created from a chunk's `history`, extended by
    the request's later chunks, dropped when the request is released. Plain requests keep nothing."""

    def __init__(self) -> None:
        self._counts: dict[str, TokenCounts] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._counts

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget these requests (a plan's releases)."""
        for rid in request_ids:
            self._counts.pop(rid, None)

    def clear(self) -> None:
        """Forget every request (a plan's release_all)."""
        self._counts.clear()

    def counts(self, chunk: Chunk) -> TokenCounts | None:
        """The request's counts as they stand when the chunk's last position samples: its history (when sent)
        replaces what the rank kept; the chunk's own tokens are taken in. None for a request that needs none."""
        if not chunk.sampling.needs_history:
            return None
        if chunk.history is not None:
            tokens = (*chunk.history, *chunk.token_ids)
            # every token before the sampled one is prompt or output; the output holds sample_index of them
            self._counts[chunk.request_id] = TokenCounts.of(tokens, len(tokens) - chunk.sample_index)
            return self._counts[chunk.request_id]
        counts = self._counts.get(chunk.request_id)
        if counts is None:
            if not chunk.sample:
                return None  # a prefill chunk before the one that carries the history
            # a coordinator's bug: every rank penalizes from the chunk alone, alike
            log.warning("request %s: a penalized chunk at %d without its history", chunk.request_id, chunk.start)
            total = chunk.start + len(chunk.token_ids)
            counts = self._counts[chunk.request_id] = TokenCounts(total - chunk.sample_index, chunk.start)
        counts.extend(chunk.start, chunk.token_ids)
        return counts


@dataclass(frozen=True)
class RowPenalty:
    """One row's adjustments, normalized: r in [float32 tiny, float32 max] (1: off), |f|, |p| <= 1e6, biases
    in [-100, 100] on ids in [0, vocab) (the last of a repeated id wins), banned ids in [0, vocab)."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()
    banned: tuple[int, ...] = ()
    seen: tuple[int, ...] = ()  # ids in the prompt or the output (sorted)
    output: tuple[tuple[int, int], ...] = ()  # (id, count) of the output (sorted)

    @staticmethod
    def of(p: SamplingParams, sample_index: int, counts: TokenCounts | None, vocab: int) -> RowPenalty | None:
        """The row's adjustments when it samples its `sample_index`-th token; None when nothing changes."""
        if not p.adjusts_logits:
            return None
        r = _number(p.repetition_penalty, 1.0)
        r = 1.0 if not r > 0 else min(max(r, _F32.tiny), _F32.max)
        f = min(max(_number(p.frequency_penalty, 0.0), -_PENALTY_MAX), _PENALTY_MAX)
        pres = min(max(_number(p.presence_penalty, 0.0), -_PENALTY_MAX), _PENALTY_MAX)
        bias: dict[int, float] = {}
        for token, value in p.logit_bias:
            b = _number(value, 0.0)
            if 0 <= token < vocab:
                bias[token] = min(max(b, -_BIAS_MAX), _BIAS_MAX)
        banned = ()
        if sample_index < p.min_tokens:
            banned = tuple(sorted({t for t in p.stop_token_ids if 0 <= t < vocab}))
        seen: tuple[int, ...] = ()
        output: tuple[tuple[int, int], ...] = ()
        if counts is not None:
            output = tuple(sorted((t, n) for t, n in counts.output.items() if 0 <= t < vocab and n > 0))
            if r != 1.0:
                seen = tuple(sorted({t for t in counts.prompt if 0 <= t < vocab} | {t for t, _ in output}))
        return RowPenalty(r, f, pres, tuple(sorted(bias.items())), banned, seen, output)


def _number(value: object, default: float) -> float:
    """A parameter as a finite-or-infinite float; NaN or no number at all is the default (off)."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return default
    return default if math.isnan(x) else x


def _flat(rows: Sequence[RowPenalty | None], entries: Callable[[RowPenalty], Iterable[tuple[int, Any]]],
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """(row indices, columns, values) of every row's entries, for one indexed read and write of the logits."""
    ri: list[int] = []
    ci: list[int] = []
    vals: list[Any] = []
    for i, row in enumerate(rows):
        for col, val in entries(row) if row is not None else ():
            ri.append(i)
            ci.append(col)
            vals.append(val)
    return (torch.tensor(ri, dtype=torch.long, device=device), torch.tensor(ci, dtype=torch.long, device=device),
            vals)


def _repeated(r: RowPenalty) -> Iterable[tuple[int, float]]:
    return ((t, r.repetition) for t in r.seen) if r.repetition != 1.0 else ()


def _in_output(r: RowPenalty) -> Iterable[tuple[int, tuple[float, float, int]]]:
    return ((t, (r.frequency, r.presence, n)) for t, n in r.output) if r.frequency or r.presence else ()


@torch.inference_mode()
def penalize(logits: torch.Tensor, rows: Sequence[RowPenalty | None]) -> torch.Tensor:
    """The logits to sample from: float32, with each row's adjustments applied (a None row is only widened).
    Rows that ask for nothing are exactly their logits (float32 widening is exact), so greedy stays the
    argmax of the model's logits for them. Each (row, id) is written once per stage: no accumulation order."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows of penalties")
    x = logits.to(torch.float32, copy=True)
    dev = x.device
    # logit_bias, then min_tokens (vLLM's logits processors)
    ri, ci, vals = _flat(rows, lambda r: r.bias, dev)
    if vals:
        x[ri, ci] = x[ri, ci] + torch.tensor(vals, dtype=torch.float32, device=dev)
    ri, ci, vals = _flat(rows, lambda r: zip(r.banned, r.banned, strict=True), dev)
    if vals:
        x[ri, ci] = float("-inf")
    # repetition: / r where > 0, * r where < 0; 0 (and NaN) as they are, so an infinite product never meets 0
    ri, ci, vals = _flat(rows, _repeated, dev)
    if vals:
        v = x[ri, ci]
        r = torch.tensor(vals, dtype=torch.float32, device=dev)
        x[ri, ci] = torch.where(v > 0, v / r, torch.where(v < 0, v * r, v))
    # frequency, then presence, over the output's tokens: |f * count| stays finite, so no inf - inf
    ri, ci, vals = _flat(rows, _in_output, dev)
    if vals:
        f, p, n = (torch.tensor(c, dtype=torch.float32, device=dev) for c in zip(*vals, strict=True))
        x[ri, ci] = (x[ri, ci] - f * n) - p
    return x
