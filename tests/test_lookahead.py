"""`chunks_ahead` gathers the pending decodes of a plan built ahead in runs of columns: it must build exactly the
chunks, and take exactly the budget and pages, of a plain statement that carries each request on by itself."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.coordinator.admission import AdmissionControl
from lockstep.coordinator.lookahead import chunks_ahead
from lockstep.coordinator.request import Request
from lockstep.steps import Chunk, Plan, PoolState, Report, SamplingParams

PS = 4


def _plain(running: list[Request], in_flight: Plan, control: AdmissionControl) -> tuple[Chunk, ...] | None:
    """Each running request's next chunk after the plan in flight, one `grow` and one `Request.chunk` each."""
    flying = {c.request_id: (c.start + len(c.token_ids), c.sample) for c in in_flight.batch}
    chunks = []
    for req in running:
        start, pending = flying.get(req.request_id, (req.num_computed, False))
        if pending and len(req.generated) + 1 >= req.max_tokens:
            continue
        left = req.num_tokens + pending - start
        if left <= 0:
            continue
        n = control.grow(start, left)
        if n:
            chunks.append(req.chunk(n, start, pending))
        elif control.tokens_left > 0:
            return None
    return tuple(chunks)


_request = st.tuples(st.integers(1, 3 * PS),  # prompt tokens
                     st.integers(0, 2 * PS),  # generated
                     st.integers(1, 3 * PS),  # max_tokens beyond generated
                     st.sampled_from(["decode", "prefill", "idle", "absent"]),  # its chunk in the plan in flight
                     st.integers(0, 3 * PS))  # of a prefill chunk: tokens computed before it


@settings(max_examples=300, deadline=None)
@given(requests=st.lists(_request, min_size=1, max_size=12), free=st.lists(st.integers(0, 4), min_size=1, max_size=2),
       charged=st.integers(0, 3), tokens=st.integers(0, 14), seed=st.integers(0, 3))
def test_chunks_ahead_is_each_request_carried_on_in_turn(requests, free, charged, tokens, seed):
    running, flight = [], []
    for i, (prompt, generated, more, kind, before) in enumerate(requests):
        req = Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(temperature=1.0, seed=seed),
                      max_tokens=generated + more)
        req.generated = list(range(7, 7 + generated)) if kind != "prefill" else []
        end = req.num_tokens
        if kind == "decode":  # its last token's chunk samples the next one
            req.num_computed = end - 1
            flight.append(Chunk(req.request_id, (end,), end - 1, True, req.sampling, len(req.generated)))
        elif kind == "prefill":  # a chunk of its prompt that does not reach the end
            req.num_computed = min(before, end - 1)
            n = max(1, (end - req.num_computed) // 2)
            flight.append(Chunk(req.request_id, tuple(range(1, n + 1)), req.num_computed, req.num_computed + n == end,
                                req.sampling, 0))
        else:
            req.num_computed = end - 1 if kind == "idle" else 0
        running.append(req)
    reports = [Report(step=0, rank=r, pools=(PoolState("full", 10, f, 0, 10 - f),)) for r, f in enumerate(free)]
    control = AdmissionControl(reports, PS, 64, tokens, len(running))
    control.charge({"full": [charged] * len(free)})
    plain_control = copy.deepcopy(control)
    in_flight = Plan(1, batch=tuple(flight))
    got = chunks_ahead(running, in_flight, control)
    want = _plain(running, in_flight, plain_control)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == want
        assert (control.room, control.tokens_left) == (plain_control.room, plain_control.tokens_left)
