"""generation.py without a server: field parsing, spec building, the text stream, and both APIs over a
fake frontend (the HTTP routes in an in-process aiohttp server, the gRPC servicer called directly)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from lockstep.coordinator.events import EventKind
from lockstep.coordinator.generation import (
    ApiError,
    Completion,
    GenerateSpec,
    SamplingFields,
    TextPiece,
    TokenEvent,
    build_spec,
    check_model,
    collect,
    parse_sampling,
    text_stream,
)
from lockstep.coordinator.request import FinishReason, Request
from lockstep.coordinator.service import Coordinator
from lockstep.steps import SamplingParams
from lockstep.tokenizer import Tokenizer

EXTRA = ["Hello", " wor", "ld", " sto", "p!", "ab\u00c3"]  # "abÃ": b"ab\xc3", the first byte of "é"
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False)


def _tokenizer() -> Tokenizer:
    """Byte-level: one token per byte, plus a few longer ones; eos is id 0."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()) + EXTRA)}
    backend = Backend(models.BPE(vocab, []))
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, {}, None, {0})


TOK = _tokenizer()
MODEL = SimpleNamespace(model_name="tiny", tokenizer=TOK, max_model_len=64)


def grpc_spec(frontend, req):
    """The gRPC API's spec of a request (async: a long prompt is encoded in a thread), from a test's own thread."""
    from lockstep.coordinator.grpc_api import request_spec

    return asyncio.run(request_spec(frontend, req))


def tid(piece: str) -> int:
    """The id of an EXTRA token, or of the one byte of a one-byte string."""
    if piece in EXTRA:
        return TOK.token_to_id(piece)
    (mapped, _), = _BYTE_LEVEL.pre_tokenize_str(piece)
    assert len(mapped) == 1, piece
    return TOK.token_to_id(mapped)


def error_of(call, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args)
    return info.value


# ----- fields and validation


def test_defaults_when_fields_are_absent_or_null():
    for body in ({}, {"temperature": None, "top_p": None, "top_k": None, "seed": None, "n": None,
                      "max_tokens": None, "stop": None, "ignore_eos": None}):
        s = parse_sampling(SamplingFields.from_json(body))
        assert s.params == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=None)
        assert s.max_tokens is None and s.stop == [] and s.ignore_eos is False


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": "hot"}, "temperature", "type integer or number, got str"),
    ({"temperature": True}, "temperature", "got a boolean"),
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"temperature": -0.1}, "temperature", "between 0 and 2"),
    ({"temperature": math.nan}, "temperature", "between 0 and 2"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": math.inf}, "top_p", "(0, 1]"),
    ({"top_k": 1.5}, "top_k", "type integer, got float"),
    ({"top_k": -2}, "top_k", "-1, 0 (off)"),
    ({"top_k": 2**40}, "top_k", "-1, 0 (off)"),
    ({"seed": 2**64}, "seed", "64-bit"),
    ({"seed": -(2**63) - 1}, "seed", "64-bit"),
    ({"n": 0}, "n", "between 1 and 16"),
    ({"n": 17}, "n", "between 1 and 16"),
    ({"n": 1.5}, "n", "type integer, got float"),
    ({"stop_token_ids": 3}, "stop_token_ids", "type array, got int"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "array of token ids"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids", "array of token ids"),
    ({"stop_token_ids": list(range(129))}, "stop_token_ids", "at most 128"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "type boolean, got int"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": "ten"}, "max_tokens", "type integer, got str"),
    ({"max_completion_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_completion_tokens": False}, "max_completion_tokens", "got a boolean"),
    ({"stop": 5}, "stop", "type string or array, got int"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["a", 1]}, "stop", "non-empty"),
    ({"ignore_eos": "yes"}, "ignore_eos", "type boolean, got str"),
])
def test_bad_sampling_fields_are_400s_naming_the_field(body, param, words):
    err = error_of(lambda: parse_sampling(SamplingFields.from_json(body)))
    assert (err.status, err.param, err.err_type) == (400, param, "invalid_request_error")
    assert words in err.message, err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


def test_good_sampling_fields():
    s = parse_sampling(SamplingFields.from_json({"temperature": 0, "top_p": 0.5, "top_k": -1, "seed": -(2**63),
                                                 "n": 1, "max_completion_tokens": 7, "stop": "##",
                                                 "ignore_eos": True}))
    assert s.params == SamplingParams(temperature=0.0, top_p=0.5, top_k=0, seed=-(2**63))
    assert isinstance(s.params.temperature, float)
    assert (s.max_tokens, s.stop, s.ignore_eos) == (7, ["##"], True)
    assert parse_sampling(SamplingFields.from_json({"max_tokens": 3, "max_completion_tokens": 9})).max_tokens == 3


def test_check_model():
    check_model(MODEL, None)
    check_model(MODEL, "tiny")
    err = error_of(check_model, MODEL, "other")
    assert (err.status, err.param, err.code, err.err_type) == (404, "model", "model_not_found", "NotFoundError")
    assert err.message == "The model 'other' does not exist; this server serves 'tiny'"


def test_build_spec():
    spec = build_spec(MODEL, SamplingFields(), [5, 6, 7])
    assert spec == GenerateSpec([5, 6, 7], SamplingParams(1.0, 1.0, 0, None), 61, [], [0], False, False)
    spec = build_spec(MODEL, SamplingFields(max_tokens=61, ignore_eos=True, stop=["x"]), [5, 6, 7])
    assert (spec.max_tokens, spec.max_tokens_given, spec.stop_token_ids, spec.stop) == (61, True, [], ["x"])


@pytest.mark.parametrize("fields, prompt, param, code", [
    (SamplingFields(), [], "prompt", None),
    (SamplingFields(), [1, TOK.vocab_size], "prompt", None),
    (SamplingFields(), [-1], "prompt", None),
    (SamplingFields(), [1] * 64, "prompt", "context_length_exceeded"),
    (SamplingFields(max_tokens=62), [1, 2, 3], "max_tokens", "context_length_exceeded"),
    (SamplingFields(temperature=3.0), [], "temperature", None),  # the fields first, then the prompt
])
def test_build_spec_refuses(fields, prompt, param, code):
    err = error_of(build_spec, MODEL, fields, prompt)
    assert (err.status, err.param, err.code) == (400, param, code)


# ----- the text stream


async def _events(*events: TokenEvent, log: list | None = None) -> AsyncGenerator[TokenEvent, None]:
    try:
        for ev in events:
            yield ev
    finally:
        if log is not None:
            log.append("closed")


def tokens(*pieces: str, reason: FinishReason = FinishReason.LENGTH, cached: int = 0) -> list[TokenEvent]:
    return [TokenEvent(tid(p), None, cached) for p in pieces] + [TokenEvent(None, reason, cached)]


def run_stream(events: list[TokenEvent], stop: list[str] = ()) -> list[TextPiece]:
    spec = GenerateSpec([1], SamplingParams(), 16, list(stop))

    async def go() -> list[TextPiece]:
        return [p async for p in text_stream(TOK, spec, _events(*events))]

    return asyncio.run(go())


def test_no_stop_streams_every_token_at_once_and_ends_with_the_reason():
    pieces = run_stream(tokens("Hello", " wor", "ld", cached=16))
    assert pieces == [TextPiece("Hello", [tid("Hello")], None, 16), TextPiece(" wor", [tid(" wor")], None, 16),
                      TextPiece("ld", [tid("ld")], None, 16), TextPiece("", [], FinishReason.LENGTH, 16)]
    assert json.dumps(pieces[-1].finish_reason) == '"length"' and pieces[-1].finish_reason == "length"


def test_a_stop_string_spanning_tokens_ends_the_text_before_it():
    pieces = run_stream(tokens("Hello", " wor", "ld", " sto", "p!", "Hello"), stop=["ld sto"])
    assert "".join(p.text for p in pieces) == "Hello wor"
    assert pieces[-1].finish_reason == FinishReason.STOP
    assert [t for p in pieces for t in p.token_ids] == [tid(p) for p in ("Hello", " wor", "ld", " sto")]


def test_text_that_may_begin_a_stop_string_is_held_back_then_released():
    pieces = run_stream(tokens("Hello", " wor", "ld"), stop=["Hello!", "xy"])
    # the last 5 characters could begin "Hello!": they wait for the next token, or the end
    assert pieces == [TextPiece("Hell", [tid("Hello"), tid(" wor")], None, 0), TextPiece("o ", [tid("ld")], None, 0),
                      TextPiece("world", [], FinishReason.LENGTH, 0)]


def test_the_earliest_of_several_stop_strings_wins():
    pieces = run_stream(tokens("Hello", " wor", "ld", " sto", "p!"), stop=["stop", "o w", "ld"])
    assert "".join(p.text for p in pieces) == "Hell" and pieces[-1].finish_reason == FinishReason.STOP


def test_a_stop_string_in_the_text_held_back_at_the_end_still_stops():
    """Bug fixed in the move: the decoder's last, held-back text (here "ab" and half a character) was
    sent at the end without the stop check, so stop "ab" was not honoured and the reason was "length"."""
    pieces = run_stream(tokens("Hello", "ab\u00c3"), stop=["ab"])
    assert "".join(p.text for p in pieces) == "Hello"
    assert pieces[-1].finish_reason == FinishReason.STOP


def test_a_character_split_over_tokens_is_sent_whole():
    second_byte = TokenEvent(TOK.token_to_id("\u00a9"))  # byte 0xa9: b"ab\xc3\xa9" is "abé"
    pieces = run_stream([TokenEvent(tid("ab\u00c3")), second_byte, TokenEvent(None, FinishReason.LENGTH)])
    assert [p.text for p in pieces] == ["ab\u00e9", ""]
    assert pieces[0].token_ids == [tid("ab\u00c3"), second_byte.token_id]


def test_error_events_raise_api_errors():
    for status, expected in ((400, (400, "max_tokens", "request_too_large", "invalid_request_error")),
                             (503, (503, None, "group_unavailable", "service_unavailable"))):
        with pytest.raises(ApiError) as info:
            run_stream([TokenEvent(tid("Hello")), TokenEvent(None, error="it broke", status=status)])
        err = info.value
        assert (err.status, err.param, err.code, err.err_type) == expected and err.message == "it broke"


def test_closing_the_text_early_closes_the_events():
    log: list[str] = []
    spec = GenerateSpec([1], SamplingParams(), 16, ["ld"])

    async def go() -> None:
        stream = text_stream(TOK, spec, _events(*tokens("Hello", " wor", "ld", "Hello"), log=log))
        assert (await anext(stream)).text == "Hell"  # stop "ld": the last character waits
        await stream.aclose()

    asyncio.run(go())
    assert log == ["closed"]
    log.clear()

    async def stopped() -> Completion:  # a stop string ends the text: the request must end too
        return await collect(text_stream(TOK, spec, _events(*tokens("Hello", " wor", "ld", "Hello"), log=log)))

    done = asyncio.run(stopped())
    assert done == Completion("Hello wor", [tid("Hello"), tid(" wor"), tid("ld")], FinishReason.STOP, 0,
                              stop_reason="ld")
    assert log == ["closed"]


# ----- enums keep their string values


def test_enums_compare_and_serialize_as_their_strings():
    assert EventKind.TOKEN == "token" and f"{EventKind.PREEMPTED}" == "preempted"
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    req = Request("r", [1, 2], max_tokens=1, stop_token_ids=[9])
    assert req.append(9) == "stop" and req.append(3) is FinishReason.LENGTH
    req.finish("abort")
    assert req.finish_reason is FinishReason.ABORT
    with pytest.raises(ValueError, match="finish reason must be one of"):
        req.finish("done")


# ----- the gRPC API: proto fields become the same typed fields


def test_grpc_optional_fields_become_sampling_fields():
    from lockstep.coordinator.grpc_api import sampling_fields
    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    assert sampling_fields(ipb.GenerateRequest(text="x")) == SamplingFields(stop=[], stop_token_ids=[])
    got = sampling_fields(ipb.GenerateRequest(text="x", temperature=0, top_p=0.5, top_k=-1, seed=3, max_tokens=4,
                                              stop=["a", "b"]))
    assert got == SamplingFields(temperature=0.0, top_p=0.5, top_k=-1, seed=3, max_tokens=4, stop=["a", "b"],
                                 stop_token_ids=[])
    spec, rid = grpc_spec(MODEL, ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6]), temperature=0,
                                                        request_id="mine"))
    assert rid == "mine" and spec.prompt_ids == [5, 6] and spec.sampling.temperature == 0.0
    assert spec.max_tokens == 62 and not spec.max_tokens_given
    spec, rid = grpc_spec(MODEL, ipb.GenerateRequest(text="Hi", model="tiny"))
    assert rid.startswith("cmpl-") and spec.prompt_ids == TOK.encode("Hi")
    for req, status, param in ((ipb.GenerateRequest(), 400, None),
                               (ipb.GenerateRequest(text="x", model="other"), 404, "model"),
                               (ipb.GenerateRequest(text="x", max_tokens=0), 400, "max_tokens"),
                               (ipb.GenerateRequest(text="x", top_p=0), 400, "top_p"),
                               (ipb.GenerateRequest(text="x", stop=[""]), 400, "stop"),
                               (ipb.GenerateRequest(text="x", temperature=math.nan), 400, "temperature")):
        err = error_of(grpc_spec, MODEL, req)
        assert (err.status, err.param) == (status, param), req


class FakeFrontend:
    """Answers every request with fixed events; records what it was asked."""

    model_name = "tiny"
    tokenizer = TOK
    max_model_len = 64

    def __init__(self, events: list[TokenEvent]) -> None:
        self.events = events
        self.asked: list[tuple[str, GenerateSpec]] = []
        self.closed: list[str] = []

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
        self.asked.append((request_id, spec))
        return _events(*self.events, log=self.closed)

    def healthy(self) -> bool:
        return True

    def health_detail(self) -> dict:
        return {"g0": {"up": True}}

    def metrics_text(self) -> bytes:
        return b""

    async def reset_prefix_cache(self, rank: int | None) -> None:
        return None

    def step_log(self, group: str | None, since: int) -> dict:
        if group not in (None, "g0"):
            raise KeyError(group)
        log = [[3, 0.001, 0.0, 0.01, 0.0, 0.009], [1, 0.002, 0.0, 0.02, 0.0, 0.019]]
        return {"group": "g0", "steps": log[since:], "next": len(log)}


def test_grpc_servicer_complete_and_generate():
    from lockstep.coordinator.grpc_api import InferenceServicer
    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    fe = FakeFrontend(tokens("Hello", " wor", "ld", reason=FinishReason.STOP, cached=16))
    servicer = InferenceServicer(fe)
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6]), return_token_ids=True, stop=["rl"])

    async def go():
        done = await servicer.Complete(req, None)
        streamed = [m async for m in servicer.Generate(req, None)]
        return done, streamed

    done, streamed = asyncio.run(go())
    assert done.text == "Hello wo" and done.finish_reason == "stop" and list(done.prompt_token_ids) == [5, 6]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.cached_tokens) == (2, 3, 16)
    assert "".join(m.text for m in streamed) == "Hello wo" and streamed[-1].finish_reason == "stop"
    assert list(streamed[0].prompt_token_ids) == [5, 6] and not streamed[-1].prompt_token_ids
    assert fe.closed == ["closed", "closed"]
    # found by a gRPC fuzz: the stream's last message carried no usage, as the proto says it does
    assert streamed[-1].HasField("usage") and not any(m.HasField("usage") for m in streamed[:-1])
    assert streamed[-1].usage == done.usage
    assert [t for m in streamed for t in m.token_ids] == list(done.token_ids)


def test_a_grpc_call_the_client_may_retry_says_when_in_grpc_retry_pushback(monkeypatch):
    """Found by a gRPC fuzz: overload was UNAVAILABLE with no retry hint, where HTTP sends Retry-After."""
    import grpc

    from lockstep.coordinator import grpc_api
    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    class Context:
        async def abort(self, code, details, trailing_metadata=()):
            self.aborted = (code, details, tuple(trailing_metadata))
            raise RuntimeError("aborted")

    def refused(status: int):
        async def request_spec(frontend, request):
            raise ApiError(status, "the server is overloaded" if status == 503 else "bad field")
        return request_spec

    async def call(status: int, streaming: bool) -> tuple:
        monkeypatch.setattr(grpc_api, "request_spec", refused(status))
        servicer, ctx = grpc_api.InferenceServicer(FakeFrontend([])), Context()
        try:
            if streaming:
                [m async for m in servicer.Generate(ipb.GenerateRequest(), ctx)]
            else:
                await servicer.Complete(ipb.GenerateRequest(), ctx)
        except RuntimeError:
            return ctx.aborted
        raise AssertionError("the call was not aborted")

    for streaming in (False, True):
        code, details, trailing = asyncio.run(call(503, streaming))
        assert code == grpc.StatusCode.UNAVAILABLE and trailing == (("grpc-retry-pushback-ms", "5000"),)
        code, _, trailing = asyncio.run(call(400, streaming))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and trailing == ()


def test_grpc_generate_sends_token_ids_only_when_asked_as_complete_does():
    """Found by a gRPC fuzz: Generate filled token_ids whatever return_token_ids said; Complete did not."""
    from lockstep.coordinator.grpc_api import InferenceServicer
    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    servicer = InferenceServicer(FakeFrontend(tokens("Hello", " wor", "ld", reason=FinishReason.LENGTH)))
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6]))

    async def go():
        return await servicer.Complete(req, None), [m async for m in servicer.Generate(req, None)]

    done, streamed = asyncio.run(go())
    assert not done.token_ids and not any(m.token_ids or m.prompt_token_ids for m in streamed)
    assert streamed[-1].usage.completion_tokens == done.usage.completion_tokens == 3


# ----- the HTTP API over the fake frontend, in process


def _http(fe: FakeFrontend, calls):
    from aiohttp.test_utils import TestClient, TestServer

    from lockstep.coordinator.openai_api import OpenAIServer

    async def go():
        async with TestClient(TestServer(OpenAIServer(fe).app())) as client:
            return [await call(client) for call in calls]

    return asyncio.run(go())


async def _post(client, path: str, body) -> tuple[int, object]:
    resp = await client.post(path, data=body if isinstance(body, bytes) else json.dumps(body))
    text = await resp.text()
    return resp.status, (json.loads(text) if resp.content_type == "application/json" else text)


async def _get(client, path: str) -> tuple[int, object]:
    resp = await client.get(path)
    return resp.status, await resp.json()


def test_http_completion_stream_and_errors():
    fe = FakeFrontend(tokens("Hello", " wor", "ld", cached=16))
    (s1, whole), (s2, sse), (s3, bad), (s4, model), (s5, junk) = _http(fe, [
        lambda c: _post(c, "/v1/completions", {"prompt": [5, 6], "return_token_ids": True, "max_tokens": 3}),
        lambda c: _post(c, "/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": {
            "include_usage": True}, "stop": ["wor"]}),
        lambda c: _post(c, "/v1/completions", {"prompt": "Hi", "top_p": 0}),
        lambda c: _post(c, "/v1/chat/completions", {"messages": [], "model": "other"}),
        lambda c: _post(c, "/v1/completions", b"{not json"),
    ])
    assert s1 == 200 and whole["choices"][0]["text"] == "Hello world" and whole["choices"][0]["finish_reason"] == \
        "length"
    assert whole["choices"][0]["token_ids"] == [tid("Hello"), tid(" wor"), tid("ld")]
    assert whole["prompt_token_ids"] == [5, 6] and whole["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}}
    assert s2 == 200
    chunks = [json.loads(line[6:]) for line in sse.split("\n") if line.startswith("data: {")]
    assert sse.rstrip().endswith("data: [DONE]")
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 2
    assert s3 == 400 and bad["error"]["param"] == "top_p"
    assert s4 == 404 and model["error"]["code"] == "model_not_found"
    assert s5 == 400 and junk["error"]["message"].startswith("the request body is not valid JSON")
    assert len(fe.asked) == 2 and fe.closed == ["closed", "closed"]


def test_http_admin_steps():
    fe = FakeFrontend([])
    got = _http(fe, [
        lambda c: _get(c, "/admin/steps"),
        lambda c: _get(c, "/admin/steps?group=g0&since=1"),
        lambda c: _get(c, "/admin/steps?group=nope"),
        lambda c: _get(c, "/admin/steps?since=x"),
        lambda c: _get(c, "/admin/steps?since=-1"),
        lambda c: _get(c, "/admin/steps?since=" + "9" * 30),
    ])
    assert got[0] == (200, {"group": "g0", "steps": fe.step_log(None, 0)["steps"], "next": 2})
    assert got[1] == (200, {"group": "g0", "steps": [[1, 0.002, 0.0, 0.02, 0.0, 0.019]], "next": 2})
    assert got[2][0] == 404 and got[2][1]["error"] == {"message": "there is no group 'nope'", "type": "NotFoundError",
                                                       "param": "group", "code": "group_not_found"}
    assert got[3][0] == 400 and got[3][1]["error"]["param"] == "since"
    assert got[4][0] == 400 and got[4][1]["error"]["param"] == "since"
    assert got[5][0] == 400 and "at most 18 digits" in got[5][1]["error"]["message"]  # an integer, too long


def test_coordinator_step_log_reads_the_groups_step_log():
    import asyncio

    from lockstep.coordinator.group import STEP_LOG_LIMIT, GroupRunner, StepTiming
    from lockstep.coordinator.metrics import Metrics

    async def main() -> None:
        metrics = Metrics()
        runners = {g: GroupRunner(g, ["127.0.0.1:1"], metrics, print, print, print) for g in ("g0", "g1")}
        g0 = runners["g0"]
        g0.step_timings.extend([StepTiming(2, 0.1, 0.0, 0.3, 0.0, 0.2), StepTiming(1, 0.1, 0.0, 0.2, 0.0, 0.1)])
        g0.steps_run = 2
        coord = SimpleNamespace(groups=runners)
        log = Coordinator.step_log(coord, None, 0)
        assert log == {"group": "g0", "next": 2,
                       "steps": [[2, 0.1, 0.0, 0.3, 0.0, 0.2, 0.0, 0.0], [1, 0.1, 0.0, 0.2, 0.0, 0.1, 0.0, 0.0]]}
        assert json.loads(json.dumps(log)) == log
        assert Coordinator.step_log(coord, "g0", 1)["steps"] == [[1, 0.1, 0.0, 0.2, 0.0, 0.1, 0.0, 0.0]]
        assert Coordinator.step_log(coord, "g0", 5) == {"group": "g0", "steps": [], "next": 2}
        assert Coordinator.step_log(coord, "g1", 0) == {"group": "g1", "steps": [], "next": 0}
        g0.steps_run = STEP_LOG_LIMIT + 2  # the oldest steps were dropped: `since` still counts from the start
        last = Coordinator.step_log(coord, "g0", STEP_LOG_LIMIT + 1)["steps"]
        assert last == [[1, 0.1, 0.0, 0.2, 0.0, 0.1, 0.0, 0.0]]
        with pytest.raises(KeyError):
            Coordinator.step_log(coord, "g2", 0)
        with pytest.raises(KeyError):
            Coordinator.step_log(SimpleNamespace(groups={}), None, 0)
        for r in runners.values():
            await r.close()

    asyncio.run(main())


# ----- logprobs: carried with their tokens, rendered as OpenAI's shapes


def _lp_events() -> list[TokenEvent]:
    from lockstep.steps import TokenLogprobs

    hello, wor, ld = tid("Hello"), tid(" wor"), tid("ld")
    return [TokenEvent(hello, None, 0, logprobs=TokenLogprobs(-0.5, ((hello, -0.5), (wor, -1.0)))),
            TokenEvent(wor, None, 0, logprobs=TokenLogprobs(-3.0, ((ld, -0.25), (hello, -0.5)))),
            TokenEvent(ld, None, 0, logprobs=TokenLogprobs(-math.inf, ((hello, -0.1), (wor, math.nan)))),
            TokenEvent(None, FinishReason.LENGTH, 0)]


def test_text_pieces_carry_each_tokens_logprobs_through_held_back_text():
    spec = GenerateSpec([1], SamplingParams(logprobs=2), 16, ["ldx"])  # holds back two characters

    async def go() -> list[TextPiece]:
        return [p async for p in text_stream(TOK, spec, _events(*_lp_events()))]

    pieces = run_stream(_lp_events())  # not asked for: none
    assert all(p.logprobs == () for p in pieces)
    pieces = asyncio.run(go())
    assert [len(p.logprobs) for p in pieces] == [len(p.token_ids) for p in pieces]
    assert [lp.logprob for p in pieces for lp in p.logprobs] == [-0.5, -3.0, -math.inf]


def test_http_logprobs_whole_and_streamed_in_openai_shapes():
    fe = FakeFrontend(_lp_events())
    fe.tokenizer = Tokenizer(TOK._backend, {}, "{% for m in messages %}{{ m['content'] }}{% endfor %}", {0})
    (s1, whole), (s2, sse), (s3, chat) = _http(fe, [
        lambda c: _post(c, "/v1/completions", {"prompt": [5], "logprobs": 1}),
        lambda c: _post(c, "/v1/completions", {"prompt": [5], "logprobs": 1, "stream": True}),
        lambda c: _post(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "logprobs": True, "top_logprobs": 1}),
    ])
    assert (s1, s2, s3) == (200, 200, 200)
    assert [spec.sampling.logprobs for _, spec in fe.asked] == [1, 1, 1]  # the ranks are asked for the top 1
    lps = whole["choices"][0]["logprobs"]
    assert lps == {"tokens": ["Hello", " wor", "ld"], "token_logprobs": [-0.5, -3.0, -9999.0],
                   # the top 1, then the sampled token when it is not among them; NaN and -inf as -9999.0
                   "top_logprobs": [{"Hello": -0.5}, {"ld": -0.25, " wor": -3.0}, {"Hello": -0.1, "ld": -9999.0}],
                   "text_offset": [0, 5, 9]}
    chunks = [json.loads(line[6:]) for line in sse.split("\n\n") if line.startswith("data: {")]
    streamed: dict[str, list] = {}
    for chunk in chunks:
        for name, values in chunk["choices"][0]["logprobs"].items():
            streamed.setdefault(name, []).extend(values)
    assert streamed == lps  # offsets count on across chunks
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[1] == {"token": " wor", "logprob": -3.0, "bytes": list(b" wor"),
                          "top_logprobs": [{"token": "ld", "logprob": -0.25, "bytes": list(b"ld")}]}
    assert content[2]["logprob"] == -9999.0 and len(content) == 3


def test_grpc_logprobs_and_their_range():
    from lockstep.coordinator.grpc_api import InferenceServicer
    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    fe = FakeFrontend(_lp_events())
    servicer = InferenceServicer(fe)
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5]), logprobs=2)

    async def go():
        return await servicer.Complete(req, None), [m async for m in servicer.Generate(req, None)]

    done, streamed = asyncio.run(go())
    assert [(m.token_id, m.logprob) for m in done.logprobs] == [(tid("Hello"), -0.5), (tid(" wor"), -3.0),
                                                                 (tid("ld"), -math.inf)]
    assert list(done.logprobs[1].top_ids) == [tid("ld"), tid("Hello")] and done.logprobs[1].top_logprobs[0] == -0.25
    assert [m for s in streamed for m in s.logprobs] == list(done.logprobs)
    assert [spec.sampling.logprobs for _, spec in fe.asked] == [2, 2]
    assert grpc_spec(MODEL, ipb.GenerateRequest(text="x")).__getitem__(0).sampling.logprobs == -1
    for bad in (-1, 21):
        err = error_of(grpc_spec, MODEL, ipb.GenerateRequest(text="x", logprobs=bad))
        assert (err.status, err.param) == (400, "logprobs")


def test_a_served_name_with_a_slash_is_retrieved_by_its_path():
    """`--served-model-name org/model` (Hugging Face's naming): GET /v1/models/org/model, slash unencoded as curl
    sends it, and encoded as the openai client sends it, is the model; another name is a 404 naming it."""
    fe = FakeFrontend([])
    fe.model_name = "org/tiny"

    async def get(client, path: str) -> tuple[int, object]:
        resp = await client.get(path)
        return resp.status, await resp.json()

    (s1, plain), (s2, encoded), (s3, other) = _http(fe, [lambda c: get(c, "/v1/models/org/tiny"),
                                                          lambda c: get(c, "/v1/models/org%2Ftiny"),
                                                          lambda c: get(c, "/v1/models/org/other")])
    assert (s1, plain["id"]) == (s2, encoded["id"]) == (200, "org/tiny")
    assert s3 == 404 and other["error"]["code"] == "model_not_found" and "org/tiny" in other["error"]["message"]
