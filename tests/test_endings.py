"""How a generation ends, without ranks: vLLM's per-choice `stop_reason` (the stop string, the stop token id, or
null for EOS and length) in the text stream, both HTTP endpoints (whole and streamed) and gRPC over a real
channel; `max_tokens: 0` with `echo` (the one token the ranks sample dropped); and gRPC prompt_logprobs. The
same against a real model: tests/test_logprobs.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from lockstep.coordinator.endings import find_stop, token_stop_reason
from lockstep.coordinator.generation import (
    ApiError,
    GenerateSpec,
    SamplingFields,
    TextPiece,
    TokenEvent,
    build_spec,
    collect,
    text_stream,
)
from lockstep.coordinator.grpc_api import start_grpc
from lockstep.coordinator.request import FinishReason
from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc
from lockstep.steps import SamplingParams, TokenLogprobs
from lockstep.tokenizer import Tokenizer
from test_choices import chunks_of
from test_generation import MODEL, TOK, FakeFrontend, _events, _http, _post, error_of, grpc_spec, tid, tokens
from test_request_edge import _free_port

C, CHAT = "/v1/completions", "/v1/chat/completions"
EOS = 0  # TOK's


def _pieces(events: list[TokenEvent], tokenizer: Tokenizer = TOK, **spec) -> list[TextPiece]:
    async def go() -> list[TextPiece]:
        return [p async for p in text_stream(tokenizer, GenerateSpec([1], SamplingParams(), 16, **spec),
                                             _events(*events))]

    return asyncio.run(go())


def _ending(events: list[TokenEvent], **spec) -> tuple[str | None, object]:
    last = _pieces(events, **spec)[-1]
    return last.finish_reason, last.stop_reason


# ----- stop_reason


def test_stop_reason_is_the_stop_string_the_stop_token_id_or_null():
    words = ["Hello", " wor", "ld", " sto", "p!"]
    assert _ending(tokens(*words), stop=["xyz", "ld"]) == ("stop", "ld")  # the string that fired
    assert _ending(tokens(*words), stop=["ld"], include_stop_str=True) == ("stop", "ld")
    assert _ending(tokens(*words, reason=FinishReason.STOP), stop=["sto", "o w"]) == ("stop", "o w")  # earliest
    stop = tid(" wor")
    assert _ending(tokens("Hello", " wor", reason=FinishReason.STOP), stop_token_ids=[EOS, stop]) == ("stop", stop)
    assert _ending(tokens("Hello", " wor", reason=FinishReason.STOP), stop_token_ids=[EOS, stop],
                   include_stop_str=True) == ("stop", stop)
    eos = [TokenEvent(tid("Hello")), TokenEvent(EOS), TokenEvent(None, FinishReason.STOP)]
    assert _ending(eos, stop_token_ids=[EOS, stop]) == ("stop", None)  # EOS: null (vLLM)
    assert _ending(eos, stop_token_ids=[EOS], ignore_eos=True) == ("stop", EOS)  # a client's stop token then
    assert _ending(tokens(*words)) == ("length", None)
    # a stop token drawn before min_tokens (the rank could draw nothing else) does not end it: the length does
    assert _ending(tokens("Hello", " wor"), stop_token_ids=[stop]) == ("length", None)
    pieces = _pieces(tokens(*words), stop=["p!"])
    assert [p.stop_reason for p in pieces] == [None] * (len(pieces) - 1) + ["p!"] and len(pieces) > 1


def test_the_tokenizers_own_eos_is_null_and_generation_configs_other_eos_ids_are_stop_token_ids():
    """vLLM: the tokenizer's eos_token ends with stop_reason null; generation_config's other EOS ids are added to
    stop_token_ids, so they are reported by id. A tokenizer that names no eos_token has every EOS id as its own."""
    named = Tokenizer(TOK._backend, {"eos_token": "Hello"}, None, {tid("Hello"), tid("ld")})
    ids = sorted(named.eos_token_ids)
    assert token_stop_reason(named, ids, False, tid("Hello")) is None
    assert token_stop_reason(named, ids, False, tid("ld")) == tid("ld")
    assert token_stop_reason(named, ids, True, tid("Hello")) == tid("Hello")  # ignore_eos: only a client's list
    assert token_stop_reason(named, ids, False, tid(" wor")) is None  # not a stop token of the request
    assert token_stop_reason(TOK, [EOS, 7], False, EOS) is None and token_stop_reason(TOK, [EOS, 7], False, 7) == 7
    assert find_stop("Hello world", ["x", "o", "ld"], 0) == (4, "o")
    assert find_stop("Hello world", ["ld"], 0, keep=True) == (11, "ld") and find_stop("Hello", ["x"], 0) is None


def test_http_choices_carry_stop_reason_whole_and_streamed():
    stop = tid(" wor")
    fe = FakeFrontend(tokens("Hello", " wor", reason=FinishReason.STOP))
    fe.tokenizer = Tokenizer(TOK._backend, {}, "{% for m in messages %}{{ m['content'] }}{% endfor %}", {EOS})
    (s1, comp), (s2, chat), (s3, sse), (s4, chat_sse), (s5, by_string) = _http(fe, [
        lambda c: _post(c, C, {"prompt": "Hi", "stop_token_ids": [stop]}),
        lambda c: _post(c, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [stop]}),
        lambda c: _post(c, C, {"prompt": "Hi", "stop_token_ids": [stop], "stream": True}),
        lambda c: _post(c, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [stop],
                                  "stream": True}),
        lambda c: _post(c, C, {"prompt": "Hi", "stop": ["lo"], "n": 2, "seed": 1}),
    ])
    assert (s1, s2, s3, s4, s5) == (200,) * 5
    assert [(c["finish_reason"], c["stop_reason"]) for c in comp["choices"] + chat["choices"]] == [("stop", stop)] * 2
    for sse_text in (sse, chat_sse):
        choices = [ch for chunk in chunks_of(sse_text) for ch in chunk["choices"]]
        assert [c["stop_reason"] for c in choices] == [None] * (len(choices) - 1) + [stop]
        assert choices[-1]["finish_reason"] == "stop"
    assert [(c["text"], c["stop_reason"]) for c in by_string["choices"]] == [("Hel", "lo")] * 2
    fe.events = tokens("Hello")  # the length ends it: null
    [(_, length)] = _http(fe, [lambda c: _post(c, C, {"prompt": "Hi", "max_tokens": 1})])
    assert length["choices"][0]["finish_reason"] == "length" and length["choices"][0]["stop_reason"] is None


# ----- max_tokens 0 with echo


def test_max_tokens_0_needs_echo_and_runs_one_token_internally():
    spec = build_spec(MODEL, SamplingFields(max_tokens=0, echo=True), [5, 6])
    assert spec.max_tokens == 1 and spec.echo_only and spec.max_tokens_given
    assert not build_spec(MODEL, SamplingFields(max_tokens=1, echo=True), [5]).echo_only
    for fields in (SamplingFields(max_tokens=0), SamplingFields(max_tokens=0, echo=False),
                   SamplingFields(max_tokens=-1, echo=True)):
        err = error_of(build_spec, MODEL, fields, [5])
        assert (err.status, err.param) == (400, "max_tokens") and "0 only with echo" in err.message
    err = error_of(build_spec, MODEL, SamplingFields(max_tokens=0, echo=True, min_tokens=1), [5])
    assert err.param == "min_tokens"


def test_max_tokens_0_drops_the_sampled_token_and_keeps_the_prompts_logprobs():
    prompt = (TokenLogprobs(-1.5, ((3, -0.5),), rank=2),)
    spec = GenerateSpec([1, 2], SamplingParams(logprobs=1, prompt_logprobs=1), 1, stop_token_ids=[EOS],
                        echo_only=True)
    for reason, token in ((FinishReason.LENGTH, tid("Hello")), (FinishReason.STOP, EOS)):
        events = [TokenEvent(token, None, 4, logprobs=TokenLogprobs(-0.1), prompt_logprobs=prompt),
                  TokenEvent(None, reason, 4)]
        done = asyncio.run(collect(text_stream(TOK, spec, _events(*events))))
        assert (done.text, done.token_ids, done.logprobs, done.finish_reason, done.stop_reason) == \
            ("", [], (), "length", None)
        assert done.prompt_logprobs == prompt and done.cached_tokens == 4
    failed = [TokenEvent(None, error="it broke", status=503)]
    with pytest.raises(ApiError, match="it broke"):
        asyncio.run(collect(text_stream(TOK, spec, _events(*failed))))


def test_http_max_tokens_0_with_echo_returns_the_prompt_and_nothing_generated():
    prompt = (TokenLogprobs(-1.5, ((tid("Hello"), -0.5),), rank=2),)
    fe = FakeFrontend([TokenEvent(tid("Hello"), None, 0, logprobs=TokenLogprobs(-0.1), prompt_logprobs=prompt),
                       TokenEvent(None, FinishReason.LENGTH, 0)])
    ids = [tid("Hello"), tid("p!")]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "return_token_ids": True}
    (s1, whole), (s2, sse), (s3, bad), (s4, shadowed), (s5, newer) = _http(fe, [
        lambda c: _post(c, C, body),
        lambda c: _post(c, C, {**body, "stream": True, "stream_options": {"include_usage": True}}),
        lambda c: _post(c, C, {"prompt": ids, "max_tokens": 0}),
        lambda c: _post(c, C, {"prompt": ids, "max_tokens": 0, "max_completion_tokens": 0, "echo": True}),
        lambda c: _post(c, C, {"prompt": ids, "max_completion_tokens": 0, "echo": True}),
    ])
    assert (s1, s2, s3, s4, s5) == (200, 200, 400, 200, 200), (whole, bad, shadowed, newer)
    assert bad["error"]["param"] == "max_tokens"
    assert fe.asked[0][1].max_tokens == 1  # what the ranks run: one token, dropped here
    choice = whole["choices"][0]
    assert choice["text"] == "Hellop!" and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert lps["token_logprobs"] == [None, -1.5] and len(lps["tokens"]) == 2  # the prompt's, and no more
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == 2
    chunks = chunks_of(sse)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == "Hellop!"
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert [t for c in chunks for ch in c["choices"] for t in ch["logprobs"]["token_logprobs"]] == [None, -1.5]


# ----- gRPC over a real channel: prompt_logprobs and stop_reason


def _grpc(fe: FakeFrontend, req: ipb.GenerateRequest) -> tuple[ipb.GenerateResponse, list[ipb.GenerateResponse]]:
    async def go():
        port = _free_port()
        server = await start_grpc(fe, "127.0.0.1", port)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                return await stub.Complete(req), [m async for m in stub.Generate(req)]
        finally:
            await server.stop(0)

    return asyncio.run(go())


def test_grpc_prompt_logprobs_come_on_the_first_message_and_in_complete():
    prompt = (TokenLogprobs(-1.5, ((3, -0.5), (4, -1.0), (5, -2.0)), rank=2), TokenLogprobs(-0.2, ((6, -0.2),), rank=1))
    stop = tid(" wor")
    fe = FakeFrontend([TokenEvent(tid("Hello"), None, 0, prompt_logprobs=prompt), TokenEvent(stop, None, 0),
                       TokenEvent(None, FinishReason.STOP, 0)])
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[7, 8, 9]), prompt_logprobs=2, stop_token_ids=[stop])
    done, streamed = _grpc(fe, req)
    assert fe.asked[0][1].sampling.prompt_logprobs == 2 and fe.asked[0][1].sampling.logprobs == -1
    want = [(8, -1.5, [3, 4], [-0.5, -1.0], 2), (9, -0.2, [6], [-0.2], 1)]  # the top cut to the k asked for

    def rows(msgs) -> list[tuple]:
        return [(m.token_id, m.logprob, list(m.top_ids), list(m.top_logprobs), m.rank) for m in msgs]

    assert rows(done.prompt_logprobs) == want and rows(streamed[0].prompt_logprobs) == want
    assert all(not m.prompt_logprobs for m in streamed[1:]) and not done.logprobs
    assert (done.finish_reason, done.WhichOneof("stop_reason"), done.stop_token_id) == ("stop", "stop_token_id", stop)
    assert streamed[-1].stop_token_id == stop and all(m.WhichOneof("stop_reason") is None for m in streamed[:-1])
    fe.events = tokens("Hello", " wor", "ld")
    done, streamed = _grpc(fe, ipb.GenerateRequest(text="Hi", stop=["wor"]))
    assert (done.text, done.stop_string, streamed[-1].stop_string) == ("Hello ", "wor", "wor")
    assert not done.prompt_logprobs and fe.asked[-1][1].sampling.prompt_logprobs == -1
    fe.events = tokens("Hello")
    done, _ = _grpc(fe, ipb.GenerateRequest(text="Hi"))
    assert done.finish_reason == "length" and done.WhichOneof("stop_reason") is None


def test_grpc_prompt_logprobs_range_is_the_servers_max_logprobs():

    for k in (-1, 21):
        err = error_of(grpc_spec, MODEL, ipb.GenerateRequest(text="x", prompt_logprobs=k))
        assert (err.status, err.param) == (400, "prompt_logprobs") and "between 0 and 20" in err.message
    spec, _ = grpc_spec(MODEL, ipb.GenerateRequest(text="x", prompt_logprobs=0, logprobs=3))
    assert (spec.sampling.prompt_logprobs, spec.sampling.logprobs) == (0, 3)
    assert error_of(grpc_spec, MODEL, ipb.GenerateRequest(text="x", max_tokens=0)).param == "max_tokens"


FROZEN_CLIENT = """
import sys, time
import grpc
from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc

stream = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(sys.argv[1])).Generate(
    ipb.GenerateRequest(text="Hi"))
next(stream)
print("streaming", flush=True)
time.sleep(600)
"""


class _Endless(FakeFrontend):
    """A generation that never ends by itself; when its events are closed (the request aborted) is recorded."""

    def generate(self, request_id: str, spec: GenerateSpec):
        self.asked.append((request_id, spec))
        return self._forever()

    async def _forever(self):
        try:
            while True:
                yield TokenEvent(tid(" wor"), None, 0)
                await asyncio.sleep(0.05)
        finally:
            self.closed.append(time.monotonic())


def test_a_grpc_client_that_answers_nothing_any_more_has_its_request_aborted(monkeypatch):
    """A streaming client frozen (SIGSTOP, cut off without a FIN or an RST) answers no keepalive ping: its call is
    cancelled and its request's events closed (the request aborted) after about two KEEPALIVE_MS. Without server
    keepalive (grpc's default pings every two hours) the request generated on for no one."""
    import os
    import signal
    import sys

    from lockstep.coordinator import grpc_api

    monkeypatch.setattr(grpc_api, "KEEPALIVE_MS", 1000)
    fe = _Endless([])

    async def go() -> float:
        port = _free_port()
        server = await start_grpc(fe, "127.0.0.1", port)
        client = await asyncio.create_subprocess_exec(sys.executable, "-c", FROZEN_CLIENT, f"127.0.0.1:{port}",
                                                      stdout=asyncio.subprocess.PIPE)
        try:
            assert (await asyncio.wait_for(client.stdout.readline(), 60)).strip() == b"streaming"
            os.kill(client.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            while not fe.closed and time.monotonic() - frozen < 15:
                await asyncio.sleep(0.1)
            assert fe.closed, "the frozen client's request still generates"
            return fe.closed[0] - frozen
        finally:
            os.kill(client.pid, signal.SIGCONT)
            client.kill()
            await client.wait()
            await server.stop(0)

    assert asyncio.run(go()) < 6
