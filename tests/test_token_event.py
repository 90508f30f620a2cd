"""`token_event` builds its Event positionally for speed: it must equal the event named field by field."""

from __future__ import annotations

from lockstep.coordinator.events import Event, EventKind, token_event
from lockstep.steps import TokenLogprobs


def test_a_token_event_is_the_event_its_fields_name():
    logprobs = TokenLogprobs(-0.5, ((7, -0.5), (3, -1.5)))
    prompt = (TokenLogprobs(-2.0, (), 1),)
    got = token_event("r1", 7, logprobs, prompt)
    assert got == Event("r1", EventKind.TOKEN, token_id=7, logprobs=logprobs, prompt_logprobs=prompt)
    assert (got.finish_reason, got.error, got.retriable) == (None, "", True)
    assert token_event("r2", 0, None, None) == Event("r2", EventKind.TOKEN, token_id=0)
