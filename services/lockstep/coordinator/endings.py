"""How a generation ends: at a stop string, with vLLM's `stop_reason`, or (max_tokens 0) before it starts.

vLLM puts `stop_reason` beside `finish_reason` in every choice: the stop string that ended the output, the
stop token id (of `stop_token_ids`) that did, or null when the model's EOS token or the length ended it.
Clients use it to tell which of several stops fired (an agent loop that stops at "Observation:" or "\\n\\n").
A completion with `echo` may ask for `max_tokens: 0`, the prompt scored and nothing generated (vLLM's
"echo without generation"); the ranks always sample one token, so that token is dropped here. Nothing here
knows a transport or the request's queue.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Collection, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import TYPE_CHECKING

from lockstep.coordinator.request import FinishReason
from lockstep.tokenizer import Tokenizer

if TYPE_CHECKING:  # generation.py imports this module
    from lockstep.coordinator.generation import GenerateSpec, TokenEvent

StopReason = str | int | None  # a stop string, a stop token id, or None (EOS, length, abort)


def find_stop(text: str, stops: Sequence[str], sent: int, keep: bool = False) -> tuple[int, str] | None:
    """(where the text ends, the stop string) at the first stop string: the text ends where it starts, or
    (`keep`, include_stop_str_in_output) where it ends; None without one. Text before `sent` holds none, so
    the search starts there."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, sent - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    return (best[0] + len(best[1]) if keep else best[0]), best[1]


def stop_after(text: str, stops: Sequence[str], min_tokens: int, keep: bool, sent: int, count: int, guard: int
               ) -> tuple[tuple[int, str] | None, int]:
    """(find_stop's answer, the new guard): vLLM looks for no stop string until more than min_tokens tokens
    are out (`count`), and then only for one that ends after the guard (the text of the min_tokens-th)."""
    if count <= min_tokens:
        return None, len(text)
    return find_stop(text, stops, max(sent, guard), keep), guard


def token_stop_reason(tokenizer: Tokenizer, stop_token_ids: Collection[int], ignore_eos: bool,
                      token_id: int | None) -> int | None:
    """vLLM's stop_reason of a request a stop token ended: None for the tokenizer's own EOS token (unless
    ignore_eos), else the token's id: a client's stop_token_ids entry, or one of generation_config's other EOS
    ids, which vLLM too adds to stop_token_ids. A tokenizer that names no EOS token has every EOS id as its own."""
    if token_id is None or token_id not in stop_token_ids:
        return None
    primary = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    own_eos = token_id == primary if primary is not None else token_id in tokenizer.eos_token_ids
    return None if own_eos and not ignore_eos else token_id


def stop_reason(tokenizer: Tokenizer, spec: GenerateSpec, reason: FinishReason, cut: tuple[int, str] | None,
                last_token: int | None) -> StopReason:
    """The stop_reason of an output that ended for `reason`: the stop string that cut it, else (finish reason
    "stop") the stop token's (token_stop_reason); None when the length or an abort ended it."""
    if cut is not None:
        return cut[1]
    if reason != FinishReason.STOP:
        return None
    return token_stop_reason(tokenizer, spec.stop_token_ids, spec.ignore_eos, last_token)


async def prompt_only(events: AsyncGenerator[TokenEvent, None]) -> AsyncGenerator[TokenEvent, None]:
    """The events of a request asked for max_tokens 0 (GenerateSpec.echo_only), which the ranks ran with
    max_tokens 1: its one token (and that token's own finish reason) dropped, the prompt's logprobs kept, and
    finish reason "length" (vLLM's). An error event passes as it is. Closing this closes the events."""
    prompt, last = None, None
    async with aclosing(events):
        async for ev in events:
            if ev.error:
                yield ev
                return
            prompt = ev.prompt_logprobs if ev.prompt_logprobs is not None else prompt
            last = ev
            if ev.finish_reason is not None:
                break
    if last is not None and last.finish_reason is not None:  # else the events ended unfinished: so does this
        yield replace(last, token_id=None, finish_reason=FinishReason.LENGTH, logprobs=None, prompt_logprobs=prompt)
