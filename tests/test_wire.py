"""Plans and reports survive the wire unchanged, and what cannot be a plan is refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.chunk_columns import ChunkColumns
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.steps import (
    PENDING_TOKEN,
    Admit,
    Chunk,
    Plan,
    PoolState,
    Probe,
    ProbeAnswer,
    PromptLogprobs,
    RankInfo,
    Report,
    Sampled,
    SamplingParams,
    Timings,
    TokenLogprobs,
)
from lockstep.wire import (
    WireError,
    _check_plan,
    info_from_proto,
    info_to_proto,
    plan_from_proto,
    plan_to_proto,
    report_from_proto,
    report_to_proto,
)

I64 = 2**63 - 1
ids = st.text(min_size=1, max_size=12)
keys = st.lists(st.binary(min_size=1, max_size=32), max_size=6).map(tuple)
counts = st.integers(0, I64)
finite = st.floats(allow_nan=False)

sampling = st.builds(
    SamplingParams,
    temperature=finite,
    top_p=finite,
    top_k=st.integers(-(2**63), I64),
    seed=st.none() | st.integers(-(2**63), I64),
    logprobs=st.integers(-1, I64),
    prompt_logprobs=st.integers(-1, I64),
    repetition_penalty=finite,
    frequency_penalty=finite,
    presence_penalty=finite,
    logit_bias=st.dictionaries(st.integers(-(2**63), I64), finite, max_size=5),
    min_tokens=counts,
    stop_token_ids=st.lists(st.integers(-(2**63), I64), max_size=4).map(tuple),
)
token_lists = st.lists(st.integers(0, I64), max_size=20).map(tuple)


def _chunks(history: tuple[int, ...] | None) -> st.SearchStrategy[Chunk]:
    return st.builds(
        Chunk,
        request_id=ids,
        token_ids=st.lists(st.integers(0, I64), min_size=1, max_size=20).map(tuple),
        start=counts if history is None else st.just(len(history)),  # a history holds tokens [0, start)
        sample=st.booleans(),
        sampling=sampling,
        sample_index=counts,
        prompt_logprobs=st.integers(-1, I64),
        next_token_id=st.integers(-1, I64),
        history=st.just(history),
    )


pending_chunks = st.builds(Chunk, request_id=ids, token_ids=st.just((PENDING_TOKEN,)), start=counts,
                           sample=st.just(True), sampling=sampling, sample_index=counts)
chunks = st.one_of(_chunks(None), token_lists.flatmap(_chunks), pending_chunks)
plans = st.builds(
    Plan,
    step=counts,
    releases=st.lists(ids, max_size=4).map(tuple),
    admits=st.lists(st.builds(Admit, request_id=ids, prefix_keys=keys), max_size=4).map(tuple),
    batch=st.lists(chunks, max_size=6).map(tuple),
    probes=st.lists(st.builds(Probe, request_id=ids, keys=keys), max_size=4).map(tuple),
    flush_prefix_cache=st.booleans(),
    release_all=st.booleans(),
)
reports = st.builds(
    Report,
    step=counts,
    rank=st.integers(0, 1024),
    sampled=st.lists(st.builds(Sampled, request_id=ids, token_id=st.integers(0, I64), logprobs=st.none() | st.builds(
        TokenLogprobs, logprob=st.floats(allow_nan=False),
        top=st.lists(st.tuples(st.integers(0, I64), st.floats(allow_nan=False)), max_size=21).map(tuple))),
        max_size=4).map(tuple),
    probes=st.lists(
        st.builds(ProbeAnswer, request_id=ids, matched_pages=counts, pinned_pages=counts,
                  sliding_runs=st.lists(st.tuples(counts, counts), max_size=3).map(tuple),
                  sliding_pinned=counts), max_size=4
    ).map(tuple),
    pools=st.lists(
        st.builds(PoolState, pool=st.text(), total=counts, free=counts, evictable=counts, used=counts, pinned=counts),
        max_size=3,
    ).map(tuple),
    error=st.text(),
    timings=st.builds(Timings, step_s=finite, forward_s=finite, rank_step_s=finite),
    prompt_logprobs=st.lists(st.builds(PromptLogprobs, request_id=ids, start=counts, entries=st.lists(st.builds(
        TokenLogprobs, logprob=finite, top=st.lists(st.tuples(st.integers(0, I64), finite), max_size=5).map(tuple),
        rank=counts), max_size=6).map(tuple)), max_size=3).map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(plans)
def test_plan_round_trip_is_lossless(plan):
    wire = pb.PlanMsg.FromString(plan_to_proto(plan).SerializeToString())
    back = plan_from_proto(wire)
    assert back == plan
    assert all(type(k) is bytes for a in back.admits for k in a.prefix_keys)
    assert isinstance(back.batch, ChunkColumns) and all(isinstance(c.token_ids, tuple) for c in back.batch)


@settings(max_examples=150, deadline=None)
@given(reports)
def test_report_round_trip_is_lossless(report):
    wire = pb.ReportMsg.FromString(report_to_proto(report).SerializeToString())
    assert report_from_proto(wire) == report


def test_a_probe_answer_with_an_odd_run_list_is_a_wire_error():
    msg = pb.ReportMsg(step=1, rank=0, probes=[pb.ProbeAnswerMsg(request_id="r", sliding_runs=[1, 2, 3])])
    with pytest.raises(WireError, match="not pairs"):
        report_from_proto(msg)


def test_seed_none_and_seed_zero_stay_apart():
    for seed in (None, 0, 7):
        chunk = Chunk("r", (1,), 0, sample=True, sampling=SamplingParams(0.7, 0.9, 40, seed))
        back = plan_from_proto(plan_to_proto(Plan(step=1, batch=(chunk,))))
        assert back.batch[0].sampling.seed == seed


def _columns(**fields) -> pb.BatchMsg:
    """One chunk's BatchMsg, each column given or its plain value."""
    one = dict(request_ids=["r"], token_counts=[1], token_ids=[1], starts=[0], sample=[False], sample_index=[0],
               sampling=[0])
    return pb.BatchMsg(**{**one, **fields})


def test_chunk_without_sampling_message_is_greedy():
    msg = pb.PlanMsg(step=3, batch=_columns(token_counts=[2], token_ids=[5, 6], starts=[2]))
    plan = plan_from_proto(msg)
    assert plan.batch[0].sampling == SamplingParams()
    assert plan == Plan(step=3, batch=(Chunk("r", (5, 6), 2),))


def test_logprobs_off_zero_and_k_stay_apart_and_an_unset_field_is_off():
    for k in (-1, 0, 5):
        chunk = Chunk("r", (1,), 0, sample=True, sampling=SamplingParams(logprobs=k))
        msg = plan_to_proto(Plan(step=1, batch=(chunk,)))
        assert pb.SamplingParamsMsg.FromString(msg.samplings[0]).HasField("logprobs") == (k != -1)
        assert plan_from_proto(msg).batch[0].sampling.logprobs == k
    with pytest.raises(WireError, match="logprobs must be -1 \\(off\\) or >= 0, got -2"):
        plan_to_proto(Plan(step=1, batch=(Chunk("r", (1,), 0, sampling=SamplingParams(logprobs=-2)),)))


def test_sampled_logprobs_cross_the_wire_and_a_torn_top_list_is_refused():
    lp = TokenLogprobs(-0.25, ((7, -0.25), (3, -1.5)))
    report = Report(step=4, rank=1, sampled=(Sampled("a", 7, lp), Sampled("b", 2), Sampled("c", 0, TokenLogprobs(
        float("-inf")))))
    back = report_from_proto(pb.ReportMsg.FromString(report_to_proto(report).SerializeToString()))
    assert back == report and back.sampled[1].logprobs is None and back.sampled[2].logprobs.top == ()
    torn = pb.ReportMsg(step=1, sampled_ids=["r"], sampled_tokens=[0], sampled_logprobs={
        0: pb.TokenLogprobsMsg(logprob=-1.0, top_ids=[1, 2], top_logprobs=[-1])})
    with pytest.raises(WireError, match="2 top ids but 1 logprobs"):
        report_from_proto(torn)
    with pytest.raises(WireError, match="2 sampled request ids but 1 tokens"):
        report_from_proto(pb.ReportMsg(step=1, sampled_ids=["r", "s"], sampled_tokens=[0]))
    with pytest.raises(WireError, match="logprobs for sampled token 1 of 1"):
        report_from_proto(pb.ReportMsg(step=1, sampled_ids=["r"], sampled_tokens=[0],
                                       sampled_logprobs={1: pb.TokenLogprobsMsg(logprob=-1.0)}))


def test_prompt_logprobs_cross_the_wire_and_torn_lists_are_refused():
    chunk = Chunk("r", (5, 6), 0, prompt_logprobs=3, next_token_id=7, sampling=SamplingParams(prompt_logprobs=3))
    msg = plan_to_proto(Plan(step=1, batch=(chunk,)))
    assert plan_from_proto(msg).batch[0] == chunk
    assert not plan_to_proto(Plan(step=1, batch=(Chunk("r", (5,), 0),))).batch.extras  # absent reads as -1
    entries = (TokenLogprobs(-1.5, ((4, -0.5), (5, -1.5)), 2), TokenLogprobs(-2.0, (), 7),
               TokenLogprobs(-0.1, ((9, -0.1),), 1))
    report = Report(step=1, rank=0, prompt_logprobs=(PromptLogprobs("r", 3, entries),))
    assert report_from_proto(report_to_proto(report)) == report
    torn = pb.ReportMsg(step=1, prompt_logprobs=[pb.PromptLogprobsMsg(request_id="r", logprobs=[-1.0], top_counts=[2],
                                                                      top_ids=[1], top_logprobs=[-1.0])])
    with pytest.raises(WireError, match="prompt logprobs of r"):
        report_from_proto(torn)
    with pytest.raises(WireError, match="next_token_id must be -1"):
        plan_to_proto(Plan(step=1, batch=(Chunk("r", (1,), 0, next_token_id=-2),)))


def test_penalties_and_an_empty_history_cross_the_wire_and_unset_fields_are_off():
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=-0.5, presence_penalty=2.0,
                       logit_bias={9: -100.0, 3: 0.5}, min_tokens=4, stop_token_ids=(2, 7))
    plan = Plan(step=1, batch=(Chunk("r", (1, 2), 0, True, p, history=()), Chunk("s", (1,), 4, True, p)))
    back = plan_from_proto(plan_to_proto(plan))
    assert back == plan and back.batch[0].history == () and back.batch[1].history is None
    assert back.batch[0].sampling.logit_bias == ((3, 0.5), (9, -100.0))
    # an older coordinator's message (no penalty fields): every one is off, repetition 1 included
    msg = pb.PlanMsg(step=1, batch=_columns(),
                     samplings=[pb.SamplingParamsMsg(temperature=0.5, top_p=1.0).SerializeToString()])
    assert plan_from_proto(msg).batch[0].sampling == SamplingParams(temperature=0.5)
    assert not plan_from_proto(msg).batch[0].sampling.adjusts_logits


def test_empty_message_is_the_default_plan():
    assert plan_from_proto(pb.PlanMsg()) == Plan(step=0)
    assert report_from_proto(pb.ReportMsg()) == Report(step=0, rank=0)


@pytest.mark.parametrize(
    "plan, words",
    [
        (Plan(step=-1), "step must be >= 0, got -1"),
        (Plan(step=2, admits=(Admit("r", ("ab",)),)), "admits[0].prefix_keys[0]: page keys are bytes, got str"),
        (Plan(step=2, probes=(Probe("r", (b"k", b"")),)), "probes[0].keys[1]: empty page key"),
        (Plan(step=2, batch=(Chunk("r", (), 0),)), "batch[0] ('r'): a chunk needs at least one token"),
        (Plan(step=2, batch=(Chunk("r", (1,), -3),)), "start must be >= 0, got -3"),
        (Plan(step=2, batch=(Chunk("r", (1, -5), 0),)), "token ids must be >= 0, got -5"),
        (Plan(step=2, releases=("",)), "releases[0]: request_id must be a non-empty string"),
        (Plan(step=2, batch=(Chunk("r", (2**64,), 0),)), "plan 2 does not fit its message"),
        (Plan(step=2, batch=(Chunk("r", (1,), 2, history=(5,)),)), "history holds the 2 tokens before"),
        (Plan(step=2, batch=(Chunk("r", (1,), 1, history=(-5,)),)), "token ids must be >= 0, got -5"),
        (Plan(step=2, batch=(Chunk("r", (1,), 0, sampling=SamplingParams(min_tokens=-1)),)), "min_tokens must be >= 0"),
    ],
)
def test_bad_plans_are_refused_by_name(plan, words):
    with pytest.raises(WireError) as e:
        plan_to_proto(plan)
    assert words in str(e.value)


def test_bad_plan_from_the_wire_is_refused():
    msg = pb.PlanMsg(step=9, batch=_columns(token_counts=[0], token_ids=[]))
    with pytest.raises(WireError, match=r"plan 9 batch\[0\] \('r'\): a chunk needs at least one token"):
        plan_from_proto(msg)
    for bad, words in [
        (_columns(starts=[0, 1]), "columns differ in length (1 request ids, 1 token counts, 2 starts"),
        (_columns(token_counts=[2]), "token counts summing to 2 (min 2) for 1 tokens"),
        (_columns(sampling=[1]), "sampling references 1..1 outside the plan's 1 sampling parameters"),
        (_columns(extras={3: pb.ChunkExtrasMsg(next_token_id=4)}), "extras for chunk 3 of 1"),
        (_columns(token_ids=[-1]), "a pending token is a decode that samples"),
        (_columns(token_counts=[2], token_ids=[4, -1], sample=[True]), "token ids must be >= 0, got -1"),
    ]:
        with pytest.raises(WireError) as e:
            plan_from_proto(pb.PlanMsg(step=9, batch=bad))
        assert words in str(e.value)
    with pytest.raises(WireError, match="sampling parameters that do not parse"):
        plan_from_proto(pb.PlanMsg(step=9, batch=_columns(), samplings=[b"\xff\xff"]))
    with pytest.raises(WireError, match="request_id must be a non-empty string"):
        plan_from_proto(pb.PlanMsg(step=1, probes=[pb.ProbeMsg(keys=[b"k"])]))


def test_report_that_does_not_fit_names_step_and_rank():
    report = Report(step=4, rank=1, pools=(PoolState("full", 2**64, 0, 0, 0),))
    with pytest.raises(WireError, match="report of step 4 from rank 1 does not fit"):
        report_to_proto(report)


def test_info_round_trip_and_what_does_not_fit():
    info = RankInfo(
        rank=1,
        world_size=3,
        model_id="smollm2",
        page_size=16,
        pools={"sliding": 512, "full": 4096},
        max_model_len=8192,
        vocab_size=49152,
    )
    assert info.pools == (("full", 4096), ("sliding", 512)) and info.last_step == -1
    back = info_from_proto(pb.RankInfo.FromString(info_to_proto(replace(info, last_step=41)).SerializeToString()))
    assert back == replace(info, last_step=41)
    assert back.pool_totals == {"full": 4096, "sliding": 512}
    with pytest.raises(WireError, match="rank info does not fit RankInfo"):
        info_to_proto(replace(info, page_size=2**64))


def test_timings_travel_by_name_and_unknown_ones_are_dropped():
    report = Report(step=1, rank=0, timings=Timings(step_s=0.5, rank_step_s=0.75))
    msg = report_to_proto(report)
    assert dict(msg.timings) == {"step_s": 0.5, "rank_step_seconds": 0.75}
    msg.timings["newer_phase_s"] = 9.0
    assert report_from_proto(msg) == report


def test_a_rank_builds_each_distinct_sampling_once_and_each_chunk_still_gets_its_own():
    """Decode plans repeat every running request's sampling parameters at every step: the rank reuses what it
    built (by the message's bytes), and parameters that differ in any field are never confused."""
    from lockstep.steps import Chunk, Plan, SamplingParams

    a, b = SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.7, seed=4)
    biased = SamplingParams(logit_bias=((5, 1.5),), min_tokens=2, stop_token_ids=(1,))
    plan = Plan(step=3, batch=tuple(Chunk(f"r{i}", (1,), 4, True, s) for i, s in enumerate((a, b, a, biased))))
    first = plan_from_proto(plan_to_proto(plan))
    again = plan_from_proto(plan_to_proto(replace(plan, step=4)))
    assert [c.sampling for c in first.batch] == [a, b, a, biased]
    assert first.batch[0].sampling is first.batch[2].sampling is again.batch[0].sampling
    assert first.batch[1].sampling is not first.batch[0].sampling and again == replace(first, step=4)


def test_a_batch_travels_in_columns_with_each_distinct_sampling_once():
    """A decode step of 256 chunks is a few packed columns and its two distinct samplings (equal parameters of
    different requests are one entry), not a message per chunk."""
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0, seed=5)
    batch = tuple(Chunk(f"r{i}", (PENDING_TOKEN,) if i % 3 else (i,), 40 + i, True,
                        SamplingParams(temperature=1.0, seed=5) if i % 2 else greedy, i) for i in range(256))
    msg = plan_to_proto(Plan(step=7, batch=batch))
    expected = [pb.SamplingParamsMsg(top_p=1.0), pb.SamplingParamsMsg(temperature=1.0, top_p=1.0, seed=5)]
    assert [pb.SamplingParamsMsg.FromString(raw) for raw in msg.samplings] == expected
    assert list(msg.batch.sampling) == [i % 2 for i in range(256)] and not msg.batch.extras
    assert list(msg.batch.token_ids)[:4] == [0, -1, -1, 3]
    back = plan_from_proto(pb.PlanMsg.FromString(msg.SerializeToString()))
    assert back.batch == batch and back.batch[1].sampling == hot and back.batch[1].pending


bad_chunks = st.builds(
    Chunk, request_id=st.sampled_from(["", "r"]), token_ids=st.lists(st.integers(-2, 3), max_size=3).map(tuple),
    start=st.integers(-1, 3), sample=st.booleans(),
    sampling=st.builds(SamplingParams, logprobs=st.integers(-2, 1), prompt_logprobs=st.integers(-2, 1),
                       min_tokens=st.integers(-1, 1)),
    sample_index=st.integers(-1, 2), prompt_logprobs=st.integers(-2, 1), next_token_id=st.integers(-2, 1),
    history=st.none() | st.lists(st.integers(-1, 2), max_size=3).map(tuple))


def _refusal(plan: Plan) -> str:
    try:
        plan_to_proto(plan)
    except WireError as e:
        return str(e)
    return ""


def _columns_refusal(batch: tuple[Chunk, ...]) -> str:
    """What a rank's check of the same chunks as columns (as it reads them off the wire) says."""
    try:
        _check_plan(Plan(step=2, batch=ChunkColumns.of(batch)))
    except WireError as e:
        return str(e)
    return ""


@settings(max_examples=400, deadline=None)
@given(st.lists(bad_chunks, max_size=4).map(tuple))
def test_a_batch_is_refused_exactly_when_one_of_its_chunks_alone_is_and_names_the_first(batch):
    """The batch check takes each distinct sampling once and formats a message only on failure: it must refuse
    what checking every chunk on its own refuses, no more, and name the first chunk that fails."""
    alone = [_refusal(Plan(step=2, batch=(chunk,))) for chunk in batch]
    first = next((i for i, why in enumerate(alone) if why), None)
    why = _refusal(Plan(step=2, batch=batch))
    if first is None:
        assert why == ""
    else:
        assert why == alone[first].replace("batch[0]", f"batch[{first}]", 1)
    assert _columns_refusal(batch) == why


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(bad_chunks, pending_chunks, st.builds(
    Chunk, request_id=st.just("d"), token_ids=st.sampled_from([(-1,), (-2,), (3,)]), start=st.integers(0, 3),
    sample=st.booleans(), history=st.none() | st.just(()))), min_size=1, max_size=5).map(tuple))
def test_columns_are_refused_exactly_when_their_chunks_are(batch):
    """The columns' own check (a few `min`s over a decode step) passes only what the per-chunk check passes, and
    a refusal names the same chunk and reason: decode-only batches with pending tokens included."""
    assert _columns_refusal(batch) == _refusal(Plan(step=2, batch=batch))


def test_a_plan_built_as_a_tuple_with_a_malformed_chunk_is_a_wire_error():
    """A plan's chunks are checked before anything reads them as columns: turning a chunk without tokens into
    columns first raised a bare TypeError, which the coordinator does not catch as a refusal (from a re-read)."""
    with pytest.raises(WireError, match=r"batch\[0\] \('r'\): a chunk needs at least one token"):
        plan_to_proto(Plan(1, batch=(Chunk("r", None, 0),)))  # type: ignore[arg-type]
