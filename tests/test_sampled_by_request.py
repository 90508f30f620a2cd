"""`sampled_by_request`'s one-report path (a dict made in C) against the general comprehension."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.coordinator.step_reports import sampled_by_request
from lockstep.steps import Report, Sampled

sampled = st.lists(st.builds(Sampled, request_id=st.sampled_from(["a", "b", "c"]), token_id=st.integers(0, 9)),
                   max_size=6).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.lists(sampled, min_size=1, max_size=3))
def test_each_request_gets_the_first_ranks_token_as_the_comprehension_gives_it(per_rank):
    reports = [Report(step=1, rank=r, sampled=s) for r, s in enumerate(per_rank)]
    expected = {s.request_id: s for report in reversed(reports) for s in report.sampled}
    got = sampled_by_request(reports)
    assert got == expected and list(got) == list(expected)
