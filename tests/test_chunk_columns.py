"""A batch kept as columns reads as the tuple of its chunks, and resolves pending tokens as chunks do."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.chunk_columns import ChunkColumns
from lockstep.engine import _resolved
from lockstep.steps import PENDING_TOKEN, Chunk, Plan, SamplingParams

hot = SamplingParams(temperature=1.0, seed=3)
chunks = st.one_of(
    st.builds(Chunk, request_id=st.sampled_from("abcdef"), token_ids=st.lists(st.integers(0, 9), min_size=1,
              max_size=5).map(tuple), start=st.integers(0, 50), sample=st.booleans(),
              sampling=st.sampled_from([SamplingParams(), hot]), sample_index=st.integers(0, 5),
              prompt_logprobs=st.integers(-1, 2), next_token_id=st.integers(-1, 3),
              history=st.none() | st.just((1, 2))),
    st.builds(Chunk, request_id=st.sampled_from("uvwxyz"), token_ids=st.just((PENDING_TOKEN,)),
              start=st.integers(0, 50), sample=st.just(True), sampling=st.just(hot), sample_index=st.integers(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(chunks, max_size=8).map(tuple), st.lists(st.integers(0, 99), min_size=8, max_size=8))
def test_columns_read_as_their_chunks_and_resolve_as_chunks_do(batch, tokens):
    cols = ChunkColumns.of(batch)
    assert cols == batch and batch == cols and tuple(cols) == batch and len(cols) == len(batch)
    assert [cols[i] for i in range(-len(batch), len(batch))] == list(batch) * 2
    assert cols[1:3] == batch[1:3]
    assert ChunkColumns.of(cols) is cols and pickle.loads(pickle.dumps(cols)) == batch
    assert [cols.tokens(i) for i in range(len(cols))] == [c.token_ids for c in batch]
    pending = [i for i, c in enumerate(batch) if c.pending]
    assert cols.pending() == pending
    drawn = tokens[:len(pending)]
    it = iter(drawn)
    expected = tuple(c.resolved(next(it)) if c.pending else c for c in batch)
    assert cols.resolved(drawn) == expected and cols == batch  # the columns it came from are unchanged
    assert _resolved(Plan(1, batch=batch), drawn).batch == expected
    assert {id(s) for s in cols.distinct_sampling} == {id(c.sampling) for c in batch}


def test_a_decode_step_is_one_token_each_and_a_zero_length_chunk_is_not():
    decode = ChunkColumns.of((Chunk("a", (PENDING_TOKEN,), 4, True), Chunk("b", (7,), 9, True)))
    assert decode.one_token_each and decode.pending() == [0]
    assert decode.resolved([5]).token_ids == [5, 7] and decode.token_ids == [PENDING_TOKEN, 7]
    overlapped = ChunkColumns.of((Chunk("a", (PENDING_TOKEN,), 4, True), Chunk("b", (PENDING_TOKEN,), 9, True)))
    assert overlapped.resolved((5, 6)) == (Chunk("a", (5,), 4, True), Chunk("b", (6,), 9, True))
    assert overlapped.pending() == [0, 1] and overlapped.token_ids == [PENDING_TOKEN] * 2
    odd = ChunkColumns.of((Chunk("a", (), 4), Chunk("b", (7,), 9)))
    assert not odd.one_token_each and odd[0].token_ids == () and odd[1].token_ids == (7,)


def test_a_wrong_number_of_tokens_or_a_chunk_past_the_end_is_refused():
    cols = ChunkColumns.of((Chunk("a", (PENDING_TOKEN,), 4, True),))
    with pytest.raises(ValueError, match="2 tokens for 1 pending chunks"):
        cols.resolved([1, 2])
    with pytest.raises(IndexError, match="chunk 1 of 1"):
        cols[1]
    assert cols != "a" and cols != (Chunk("a", (5,), 4, True),) and cols != list(cols)
    assert hash(ChunkColumns.of(())) == hash(()) and ChunkColumns.of(()) != []
    with pytest.raises(TypeError, match="unhashable"):
        hash(cols)


def test_columns_read_while_being_built_are_read_again_after_more_chunks():
    """What the columns derive (one token each, offsets, distinct parameters) is cached on first read: a batch
    still being built must not keep what it derived from fewer chunks (from a review)."""
    b = ChunkColumns.empty()
    b.append(Chunk("a", (5,), 3, True))
    assert b == (Chunk("a", (5,), 3, True),) and b.one_token_each
    b.append(Chunk("b", (7, 8, 9), 0, True, SamplingParams(temperature=1.0)))
    b.extend_pending(["c"], [4], [SamplingParams(temperature=0.5)], [2])
    assert tuple(b)[1].token_ids == (7, 8, 9) and not b.one_token_each and b.offsets == [0, 1, 4, 5]
    assert len(b.distinct_sampling) == 3 and b.pending() == [2]


def test_pending_decodes_extend_every_column_or_are_refused_when_the_columns_differ_in_length():
    b = ChunkColumns.empty()
    b.extend_pending(["a", "b"], [4, 9], [hot, hot], [1, 2])
    assert b == (Chunk("a", (PENDING_TOKEN,), 4, True, hot, 1), Chunk("b", (PENDING_TOKEN,), 9, True, hot, 2))
    with pytest.raises(ValueError, match="2 request ids, 1 starts"):
        b.extend_pending(["c", "d"], [1], [hot, hot], [1, 1])
    assert len(b) == 2 and len(b.starts) == len(b.sampling) == 2
