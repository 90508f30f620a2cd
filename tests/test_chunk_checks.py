"""The column-wise fast paths of a plan's translation against the chunk-by-chunk paths they stand for."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.chunk_checks import chunk_error, columns_pass, sampling_error
from lockstep.chunk_columns import ChunkColumns
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.steps import PENDING_TOKEN, Chunk, Plan, SamplingParams
from lockstep.wire import plan_to_proto, sampling_bytes

GREEDY, HOT, BAD = SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams(logprobs=-2)
# objects, some of equal value but distinct (a request made before interning, a test's own)
OBJECTS = [GREEDY, SamplingParams(), HOT, replace(HOT), SamplingParams(temperature=1.0, seed=6), BAD,
           SamplingParams(min_tokens=-1), SamplingParams(prompt_logprobs=-3)]

chunks = st.builds(
    Chunk, request_id=st.sampled_from(["", "r", "s"]),
    token_ids=st.lists(st.integers(-2, 3), min_size=0, max_size=3).map(tuple) | st.just((PENDING_TOKEN,)),
    start=st.integers(-1, 3), sample=st.booleans(), sampling=st.sampled_from(OBJECTS),
    sample_index=st.integers(-1, 2), prompt_logprobs=st.integers(-2, 1), next_token_id=st.integers(-2, 1),
    history=st.none() | st.lists(st.integers(-1, 2), max_size=3).map(tuple))
decodes = st.builds(Chunk, request_id=st.sampled_from(["r", "s", ""]), token_ids=st.sampled_from([(-1,), (-2,), (7,)]),
                    start=st.integers(0, 3), sample=st.booleans(), sampling=st.sampled_from(OBJECTS))


def _every_chunk_passes(batch: list[Chunk]) -> bool:
    return all(not chunk_error(c) and not sampling_error(c.sampling) for c in batch)


@settings(max_examples=500, deadline=None)
@given(st.lists(chunks | decodes, max_size=6) | st.lists(decodes, min_size=1, max_size=8))
def test_columns_pass_exactly_when_every_chunk_does(batch):
    """`columns_pass` (type sets, `min`s, `all`s, parameters checked once in their life) says what the per-chunk
    check says, on a first look at the parameters and on a second (from its cache of passed values)."""
    expected = _every_chunk_passes(batch)
    assert columns_pass(ChunkColumns.of(batch)) == expected
    assert columns_pass(ChunkColumns.of(batch)) == expected


def _reference_table(batch: list[Chunk]) -> tuple[list[bytes], list[int]]:
    """Each distinct value in first-seen order, and each chunk's index into them: the message as it was built."""
    table: dict[SamplingParams, int] = {}
    refs = [table.setdefault(c.sampling, len(table)) for c in batch]
    return [sampling_bytes(s) for s in table], refs


good = [s for s in OBJECTS if not sampling_error(s)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(good) | st.integers(0, 3).map(lambda k: SamplingParams(temperature=0.5, seed=k)),
                min_size=0, max_size=12))
def test_the_sampling_table_is_each_value_once_in_first_seen_order(samplings):
    """All distinct (references 0..n-1 without a lookup) or some shared, by identity or by value only."""
    batch = [Chunk(f"r{i}", (1,), 0, True, s) for i, s in enumerate(samplings)]
    msg = plan_to_proto(Plan(step=1, batch=ChunkColumns.of(batch)))
    blobs, refs = _reference_table(batch)
    assert list(msg.samplings) == blobs and list(msg.batch.sampling) == refs
    assert pb.PlanMsg.FromString(msg.SerializeToString()) == msg
