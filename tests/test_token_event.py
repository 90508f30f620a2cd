"""`token_event` and `token_out` build their events positionally for speed: each must equal the event named field
by field."""

from __future__ import annotations

from lockstep.coordinator.events import Event, EventKind, token_event
from lockstep.coordinator.generation import TokenEvent
from lockstep.coordinator.request_events import token_out
from lockstep.steps import TokenLogprobs


def test_a_token_event_is_the_event_its_fields_name():
    logprobs = TokenLogprobs(-0.5, ((7, -0.5), (3, -1.5)))
    prompt = (TokenLogprobs(-2.0, (), 1),)
    got = token_event("r1", 7, logprobs, prompt)
    assert got == Event("r1", EventKind.TOKEN, token_id=7, logprobs=logprobs, prompt_logprobs=prompt)
    assert (got.finish_reason, got.error, got.retriable) == (None, "", True)
    assert token_event("r2", 0, None, None) == Event("r2", EventKind.TOKEN, token_id=0)


def test_a_token_out_is_the_token_event_its_fields_name():
    """`token_out` builds the dispatch's TokenEvent positionally: a reorder of TokenEvent's fields must fail here."""
    logprobs = TokenLogprobs(-0.5, ((7, -0.5), (3, -1.5)))
    prompt = (TokenLogprobs(-2.0, (), 1),)
    got = token_out(7, 3, logprobs, prompt)
    assert got == TokenEvent(7, cached_tokens=3, logprobs=logprobs, prompt_logprobs=prompt)
    assert (got.finish_reason, got.error, got.status) == (None, "", 503)
    assert token_out(0, 0, None, None) == TokenEvent(0)
