"""A request's sampling parameters as a plan carries them: one object per value, unless its seed was drawn."""

from __future__ import annotations

from lockstep.coordinator.request import Request
from lockstep.steps import SamplingParams


def test_requests_share_the_object_of_equal_parameters_unless_a_seed_was_drawn():
    """Greedy requests (and those that name a seed) hold one object per value, so a plan's table looks each
    up by identity; a request at temperature > 0 without a seed gets its own, and keeps its value."""
    a, b = Request("a", [1, 2], SamplingParams()), Request("b", [3], SamplingParams())
    assert a.sampling is b.sampling == SamplingParams()
    seeded = [Request(f"s{i}", [1], SamplingParams(temperature=0.8, seed=9)) for i in range(2)]
    assert seeded[0].sampling is seeded[1].sampling and seeded[0].sampling.seed == 9
    drawn = [Request(f"d{i}", [1], SamplingParams(temperature=0.8)) for i in range(2)]
    assert drawn[0].sampling is not drawn[1].sampling and drawn[0].sampling.seed is not None
    held = Request("h", [1], SamplingParams(min_tokens=2), stop_token_ids=[5, 4])
    assert held.sampling.stop_token_ids == (4, 5) and held.sampling is not a.sampling
    assert Request("h2", [1], SamplingParams(min_tokens=2), stop_token_ids=[4, 5]).sampling is held.sampling
