"""Request.token_ids slices prompt + generated without building the whole sequence; it must slice exactly as
that sequence would, for every start and end a caller can pass (negative and None included)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lockstep.coordinator.request import Request

BOUNDS = st.one_of(st.none(), st.integers(-40, 40))


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12),
       generated=st.lists(st.integers(0, 99), max_size=12), start=BOUNDS, end=BOUNDS)
def test_token_ids_slice_prompt_and_generated_as_one_sequence(prompt, generated, start, end):
    req = Request("r", prompt, max_tokens=64)
    req.generated.extend(generated)
    whole = tuple(prompt) + tuple(generated)
    got = req.token_ids(0 if start is None else start, end)
    assert got == whole[0 if start is None else start:end]
    assert type(got) is tuple
