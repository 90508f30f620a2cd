"""What makes a plan's chunks and their sampling parameters valid, as `wire` checks them on both sides.

Each check returns why a chunk cannot be one ("" when it can), so `wire` formats a message naming the chunk only
for one that fails. A plan's columns are checked first as columns (`columns_pass`): a decode step of 256 requests
passes in a few C-level passes over its lists, and only a batch that does not goes chunk by chunk.
"""

from __future__ import annotations

from lockstep.chunk_columns import ChunkColumns
from lockstep.steps import PENDING_TOKEN, Chunk, SamplingParams

# parameters `sampling_error` passed, by identity (a request keeps its object for its life; equal but distinct
# objects would cost a dataclass `__eq__` each): held here, so no other object takes the same id while listed
_PASSED: dict[int, SamplingParams] = {}
_PASSED_MAX = 1 << 14


def columns_pass(b: ChunkColumns) -> bool:
    """Whether every chunk passes `chunk_error` and its sampling `sampling_error`, column by column (a plan of 256
    decodes is a few `min`s); False sends the batch to the per-chunk check, which names what fails."""
    ids = b.request_ids
    if not ids:
        return True
    if set(map(type, ids)) != {str} or not all(ids) or min(b.token_counts) < 1 or min(b.starts) < 0:
        return False
    if min(b.sample_index) < 0 or not samplings_pass(b.distinct_sampling) or not _extras_pass(b):
        return False
    lowest = min(b.token_ids)
    if lowest >= 0:
        return True
    if lowest != PENDING_TOKEN or not b.one_token_each:  # a token below it is no token, nor pending
        return False
    return all(b.sample) or all(b.sample[i] for i, t in enumerate(b.token_ids) if t < 0)


def samplings_pass(samplings: list[SamplingParams]) -> bool:
    """Whether no parameters have a `sampling_error`; each object is checked once in its life, as the same
    request's parameters come again every step."""
    if all(map(_PASSED.__contains__, map(id, samplings))):
        return True
    if any(sampling_error(s) for s in samplings):
        return False
    if len(_PASSED) + len(samplings) > _PASSED_MAX:
        _PASSED.clear()
    _PASSED.update(zip(map(id, samplings), samplings, strict=True))
    return True


def _extras_pass(b: ChunkColumns) -> bool:
    """`columns_pass` for the fields only a few chunks carry."""
    for i, (prompt_logprobs, next_token_id, history) in b.extras.items():
        if prompt_logprobs < -1 or next_token_id < -1:
            return False
        if history is not None and (len(history) != b.starts[i] or b.token_ids[b.offsets[i]] == PENDING_TOKEN
                                    or (history and min(history) < 0)):
            return False
    return True


def chunk_error(c: Chunk) -> str:
    """Why the chunk cannot be one, its sampling aside; "" when it can."""
    if type(c.request_id) is not str or not c.request_id:
        return "request_id must be a non-empty string"
    if not c.token_ids:
        return "a chunk needs at least one token"
    if c.start < 0:
        return f"start must be >= 0, got {c.start}"
    if c.sample_index < 0:
        return f"sample_index must be >= 0, got {c.sample_index}"
    if c.prompt_logprobs < -1:
        return f"chunk prompt_logprobs must be -1 (off) or >= 0, got {c.prompt_logprobs}"
    if c.next_token_id < -1:
        return f"next_token_id must be -1 (off) or >= 0, got {c.next_token_id}"
    return _tokens_error(c)


def _tokens_error(c: Chunk) -> str:
    """Why the chunk's tokens and history cannot be; "" when they can."""
    tokens, history = c.token_ids, c.history
    if history is not None and len(history) != c.start:
        return f"a history holds the {c.start} tokens before the chunk, got {len(history)}"
    if tokens == (PENDING_TOKEN,):
        if not c.sample or history is not None:
            return "a pending token is a decode that samples, without history"
    elif min(tokens) < 0:
        return f"token ids must be >= 0, got {next(t for t in tokens if t < 0)}"
    if history and min(history) < 0:
        return f"token ids must be >= 0, got {next(t for t in history if t < 0)}"
    return ""


def sampling_error(s: SamplingParams) -> str:
    """Why the parameters cannot go in a plan ("" when they can): the fields the rank reads as 'off' below 0."""
    if s.logprobs < -1:
        return f"logprobs must be -1 (off) or >= 0, got {s.logprobs}"
    if s.prompt_logprobs < -1:
        return f"prompt_logprobs must be -1 (off) or >= 0, got {s.prompt_logprobs}"
    return f"min_tokens must be >= 0, got {s.min_tokens}" if s.min_tokens < 0 else ""
