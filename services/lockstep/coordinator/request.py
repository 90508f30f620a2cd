"""The coordinator's record of one request: what it asked for and how far the ranks have computed it.

The ranks hold positions [0, num_computed) of the request's tokens (prompt, then generated). Every token
after that is still to be computed, so a decode is simply a request with one uncomputed token (the one
sampled last step) and a recompute after preemption is a prefill of prompt + generated.
"""

from __future__ import annotations

import enum
import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import replace

from lockstep.kv.page_keys import page_keys
from lockstep.steps import PENDING_TOKEN, Chunk, PromptLogprobs, SamplingParams, TokenLogprobs

SEED_MASK = (1 << 63) - 1
GREEDY = SamplingParams()


class FinishReason(enum.StrEnum):
    """Why a request ended; a str, so it is OpenAI's `finish_reason` as it is (JSON, protobuf, ==)."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens
    ABORT = "abort"  # the client went away, or a stop string ended it at the API
    ERROR = "error"  # it could not be served (see Request.error)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def default_seed() -> int:
    """A fresh seed for a request that names none, drawn once and kept with it, so every rank and every recompute
    samples alike. Not derived from the request id: a gRPC client picks its own, and a retry under the same id
    must draw afresh (found by a helper: three calls with `request_id` "job-1" gave the same text)."""
    return secrets.randbits(63) & SEED_MASK


def _token_ids(name: str, tokens: Iterable[int]) -> tuple[int, ...]:
    out = tuple(tokens)
    for i, t in enumerate(out):
        if type(t) is not int or t < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative int token id, got {t!r}")
    return out


INT64 = 1 << 63  # the wire carries seeds and top_k as int64


def _check_sampling(sampling: SamplingParams) -> None:
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {sampling.temperature!r}")
    if not (0 < sampling.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p!r}")
    if type(sampling.top_k) is not int or not 0 <= sampling.top_k < INT64:
        raise ValueError(f"top_k must be an int >= 0 (0: off), got {sampling.top_k!r}")
    if sampling.seed is not None and (type(sampling.seed) is not int or not -INT64 <= sampling.seed < INT64):
        raise ValueError(f"seed must be a 64-bit signed int or None, got {sampling.seed!r}")
    if type(sampling.prompt_logprobs) is not int or sampling.prompt_logprobs < -1:
        raise ValueError(f"prompt_logprobs must be -1 (off) or an int >= 0, got {sampling.prompt_logprobs!r}")
    _check_penalties(sampling)


_SHARED: dict[SamplingParams, SamplingParams] = {}
_SHARED_MAX = 1 << 14  # distinct values held at once; a full table starts over


def shared_sampling(sampling: SamplingParams) -> SamplingParams:
    """The one object of `sampling`'s value that requests hold: a plan's batch repeats every request's parameters,
    and its translation (wire.py) looks each up by value, which for equal but distinct objects costs a dataclass
    `__eq__` a chunk (at batch 256 of greedy requests, about 60 us a step); for one object, an identity check."""
    found = _SHARED.get(sampling)
    if found is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        found = _SHARED[sampling] = sampling
    return found


def _check_penalties(sampling: SamplingParams) -> None:
    if not (math.isfinite(sampling.repetition_penalty) and sampling.repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {sampling.repetition_penalty!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(sampling, name) <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(sampling, name)!r}")
    if type(sampling.min_tokens) is not int or sampling.min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {sampling.min_tokens!r}")


class Request:
    """One request as the scheduler tracks it; the service keeps the object it passed to `add`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams = GREEDY,
        max_tokens: int = 16,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = _token_ids("prompt_token_ids", prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be an int >= 1, got {max_tokens!r}")
        _check_sampling(sampling)
        self.request_id = request_id
        self.prompt_token_ids = prompt
        # a greedy request draws nothing, so it gets no seed: its parameters stay the ones every greedy request of
        # its kind shares, and a plan's table holds them once (a seed each made 256 entries of a step at batch 256)
        drawn = sampling.seed is None and sampling.temperature > 0
        seed = default_seed() if drawn else sampling.seed
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(_token_ids("stop_token_ids", stop_token_ids))
        # the ranks hold the stop ids off while min_tokens are not generated (and only then need them)
        held = tuple(sorted(self.stop_token_ids)) if sampling.min_tokens > 0 else ()
        sampling = replace(sampling, seed=seed, stop_token_ids=held)
        self.sampling = sampling if drawn else shared_sampling(sampling)  # a drawn seed is this request's alone
        # the preemption count at which the ranks got this request's token history (penalties); -1: never
        self._history_at = -1
        self.generated: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.error = ""
        self.num_preemptions = 0
        self._keys: list[bytes] = []
        # with sampling.prompt_logprobs: entry i is prompt token i + 1's, as the first rank reported it
        self.prompt_logprobs: list[TokenLogprobs] = []

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)},"
            f" generated={len(self.generated)}/{self.max_tokens}, computed={self.num_computed})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.generated)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def max_positions(self) -> int:
        """Positions the ranks hold at most: the last sampled token is never fed back."""
        return len(self.prompt_token_ids) + self.max_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int = 0, end: int | None = None) -> tuple[int, ...]:
        """Tokens [start, end) of prompt + generated, without building the whole sequence (a decode step asks
        for one token of a context that may be long)."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        start, end, _ = slice(start, end).indices(n + len(self.generated))
        if end <= start:
            return ()
        if start >= n:
            return tuple(self.generated[start - n:end - n])
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + tuple(self.generated[:end - n])

    def append(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; returns STOP or LENGTH when it ends the request."""
        if type(token_id) is not int or token_id < 0:
            raise ValueError(f"request {self.request_id}: sampled token {token_id!r} is not a token id")
        self.generated.append(token_id)
        self._history_at = self.num_preemptions  # a sampled chunk ran: the ranks hold the history it carried
        # vLLM: no stop token ends a request before min_tokens (the ranks hold them off; this is for a row
        # where nothing else could be drawn)
        if token_id in self.stop_token_ids and len(self.generated) >= self.sampling.min_tokens:
            return FinishReason.STOP
        if len(self.generated) >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def chunk(self, n: int, start: int | None = None, pending: bool = False) -> Chunk:
        """The chunk of the next `n` uncomputed tokens. A penalized request's first sampling chunk since it was
        (re)admitted carries its tokens before the chunk, from which the ranks count penalties (Chunk.history).

        Planned ahead (overlap), the chunk starts at `start`, where the plan in flight leaves the request, and
        with `pending` that plan samples a token not known yet: the chunk is that one token, as PENDING_TOKEN.
        """
        start = self.num_computed if start is None else start
        end = start + n
        if pending:
            if start != self.num_tokens or n != 1:
                raise ValueError(f"{self!r}: a pending token is the one token at position {self.num_tokens}")
            return Chunk(self.request_id, (PENDING_TOKEN,), start, True, self.sampling, len(self.generated) + 1)
        k, next_token = self.prompt_scoring(start, end)  # echo's prompt logprobs, where still to compute
        sample = end == self.num_tokens
        history = None
        if sample and self.sampling.needs_history and self._history_at != self.num_preemptions:
            history = self.token_ids(0, start)
        return Chunk(self.request_id, self.token_ids(start, end), start, sample, self.sampling, len(self.generated),
                     k, next_token, history)

    @property
    def scoring_prompt(self) -> bool:
        """Whether some prompt token's logprob is still to be computed: until then no cached prefix may be
        skipped (a skipped position is never computed, so it would have no logprob)."""
        return self.sampling.prompt_logprobs >= 0 and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def prompt_scoring(self, start: int, end: int) -> tuple[int, int]:
        """(k, next token id) for the chunk of positions [start, end): k = -1 when it scores nothing new; the
        next token is the prompt token after the chunk, which its last position predicts (-1: none)."""
        prompt = self.prompt_token_ids
        if not self.scoring_prompt or end <= len(self.prompt_logprobs):
            return -1, -1
        return self.sampling.prompt_logprobs, prompt[end] if end < len(prompt) else -1

    def take_prompt_scores(self, prompt_logprobs: int, scores: PromptLogprobs | None) -> bool:
        """Keep the entries of positions not reported yet (a recompute after preemption scores them again).
        False when the chunk asked for scores (its `prompt_logprobs` >= 0) and the ranks sent none: a rank's bug,
        which fails the request."""
        if prompt_logprobs < 0:
            return True
        if scores is None:
            return False
        for i, entry in enumerate(scores.entries):
            position = scores.start + i
            if position == len(self.prompt_logprobs) and position + 1 < len(self.prompt_token_ids):
                self.prompt_logprobs.append(entry)
        return True

    def prompt_logprobs_to_send(self) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's logprobs, to go with the first generated token (once); None otherwise."""
        first = self.sampling.prompt_logprobs >= 0 and len(self.generated) == 1
        return tuple(self.prompt_logprobs) if first else None

    def finish(self, reason: FinishReason | str, error: str = "") -> None:
        """End the request; `reason` is a FinishReason or its value."""
        try:
            reason = FinishReason(reason)
        except ValueError:
            choices = tuple(r.value for r in FinishReason)
            raise ValueError(f"finish reason must be one of {choices}, got {reason!r}") from None
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def forget_keys(self) -> None:
        """Drop the cached page keys: the request moves to a group whose salt may differ."""
        self._keys = []

    def page_keys(self, num_pages: int, page_size: int, salt: bytes) -> tuple[bytes, ...]:
        """Keys of the first num_pages full pages; the chain is extended once and kept (tokens only grow)."""
        self._extend_keys(num_pages, page_size, salt)
        return tuple(self._keys[:num_pages])

    def page_key(self, page: int, page_size: int, salt: bytes) -> bytes:
        """The key of full page `page` alone (no copy of the chain before it: callers compare one page)."""
        self._extend_keys(page + 1, page_size, salt)
        return self._keys[page]

    def _extend_keys(self, num_pages: int, page_size: int, salt: bytes) -> None:
        if num_pages * page_size > self.num_tokens:
            raise ValueError(f"request {self.request_id} has {self.num_tokens} tokens, not {num_pages} full pages")
        have = len(self._keys)
        if have < num_pages:
            parent = self._keys[-1] if self._keys else None
            tokens = self.token_ids(have * page_size, num_pages * page_size)
            self._keys.extend(page_keys(tokens, page_size, salt, parent))
