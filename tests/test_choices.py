"""n choices, stop token ids, echo and chat content parts, through the HTTP app over a fake frontend (in
process): what each choice is asked with, how the answers are put together, and that a refused, failed or
abandoned request aborts every one of its choices."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import aiohttp
import pytest

from lockstep.coordinator.choices import choice_ids, choice_specs, interleave
from lockstep.coordinator.generation import (
    SEED_MAX,
    SEED_MIN,
    ApiError,
    GenerateSpec,
    SamplingFields,
    TextPiece,
    TokenEvent,
    build_spec,
    text_stream,
)
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.request import FinishReason
from lockstep.steps import SamplingParams
from lockstep.tokenizer import Tokenizer
from test_generation import MODEL, TOK, FakeFrontend, _events, _http, _post, tid, tokens
from test_request_edge import Hanging, _free_port

C, CHAT = "/v1/completions", "/v1/chat/completions"
WORDS = ["Hello", " wor", "ld", " sto", "p!"]


class PerChoice(FakeFrontend):
    """Choice i answers WORDS[i] then WORDS[i + 1] (length); records what each choice was asked."""

    # a newline is no token of TOK: the template shows it as "/"
    tokenizer = Tokenizer(TOK._backend, {}, "{% for m in messages %}{{ m['content'] | replace('\\n', '/') }}|"
                                            "{% endfor %}", {0})

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
        i = int(request_id.split("-")[2]) if request_id.count("-") == 2 else 0  # cmpl-<hex>-<choice>
        self.asked.append((request_id, spec))
        return _events(*tokens(WORDS[i], WORDS[i + 1], cached=4 + i), log=self.closed)


class Events:
    """A coordinator's events as service.RequestEvents behaves: closing it, even unstarted, aborts it."""

    def __init__(self, rid: str, aborted: list[str], events: list[TokenEvent], hang: bool = False) -> None:
        self.rid, self.aborted, self.events, self.done, self.hang = rid, aborted, list(events), False, hang

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> TokenEvent:
        if not self.events and self.hang:
            await asyncio.Event().wait()  # a request that runs until it is aborted
        if not self.events:
            self.done = True
            raise StopAsyncIteration
        ev = self.events.pop(0)
        self.done = ev.finish_reason is not None or bool(ev.error)
        return ev

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.aborted.append(self.rid)


def chunks_of(sse: str) -> list[dict]:
    assert sse.rstrip().endswith("data: [DONE]"), sse
    return [json.loads(line[6:]) for line in sse.split("\n") if line.startswith("data: {")]


# ----- choice specs


def test_each_choice_has_its_own_seed_and_id():
    spec = build_spec(MODEL, SamplingFields(seed=7, n=3, temperature=1.0), [5, 6])
    specs = choice_specs(spec)
    assert [s.sampling.seed for s in specs] == [7, 8, 9] and {s.n for s in specs} == {1}
    assert [s.choice for s in specs] == [0, 1, 2]
    assert all(s.prompt_ids == [5, 6] and s.max_tokens == spec.max_tokens for s in specs)
    assert choice_ids("cmpl-x", 3) == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"] and choice_ids("r", 1) == ["r"]
    top = choice_specs(build_spec(MODEL, SamplingFields(seed=SEED_MAX, n=2), [5]))
    assert [s.sampling.seed for s in top] == [SEED_MAX, SEED_MIN]  # wrapped: still a 64-bit seed
    unseeded = choice_specs(build_spec(MODEL, SamplingFields(n=2), [5]))
    assert [s.sampling.seed for s in unseeded] == [None, None]  # each choice's request draws a fresh seed
    one = build_spec(MODEL, SamplingFields(seed=7), [5])
    assert choice_specs(one) == [one]


# ----- stop token ids, include_stop_str_in_output


def test_stop_token_ids_join_eos_unless_ignored():
    assert build_spec(MODEL, SamplingFields(stop_token_ids=[9, 3, 9]), [5]).stop_token_ids == [0, 3, 9]
    assert build_spec(MODEL, SamplingFields(stop_token_ids=[9], ignore_eos=True), [5]).stop_token_ids == [9]
    spec = build_spec(MODEL, SamplingFields(include_stop_str_in_output=True), [5])
    assert spec.include_stop_str and spec.stop_token_ids == [0]


def _stream(events: list[TokenEvent], **spec) -> list[TextPiece]:
    async def go() -> list[TextPiece]:
        return [p async for p in text_stream(TOK, GenerateSpec([1], SamplingParams(), 16, **spec), _events(*events))]

    return asyncio.run(go())


def test_a_stop_token_ends_the_text_without_its_text_but_with_its_id():
    stop = tid(" wor")
    events = tokens("Hello", " wor", reason=FinishReason.STOP)
    pieces = _stream(events, stop_token_ids=[0, stop])
    assert "".join(p.text for p in pieces) == "Hello" and pieces[-1].finish_reason == FinishReason.STOP
    assert [t for p in pieces for t in p.token_ids] == [tid("Hello"), stop]  # vLLM: the id stays in token_ids
    kept = _stream(events, stop_token_ids=[0, stop], include_stop_str=True)
    assert "".join(p.text for p in kept) == "Hello wor"
    # the same token, not a stop token of this request, is text like any other
    assert "".join(p.text for p in _stream(events, stop_token_ids=[0])) == "Hello wor"


def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_after_it():
    events = tokens("Hello", " wor", "ld", " sto", "p!")
    assert "".join(p.text for p in _stream(events, stop=["wor"])) == "Hello "
    pieces = _stream(events, stop=["wor"], include_stop_str=True)
    assert "".join(p.text for p in pieces) == "Hello wor" and pieces[-1].finish_reason == FinishReason.STOP
    assert "".join(p.text for p in _stream(events, stop=["o w", "ld s"], include_stop_str=True)) == "Hello w"


# ----- n choices over HTTP


def test_n_choices_whole_answer():
    fe = PerChoice([])
    (status, body), = _http(fe, [lambda c: _post(c, C, {"prompt": [5, 6, 7], "n": 3, "seed": 11, "temperature": 1,
                                                      "return_token_ids": True, "max_tokens": 2})])
    assert status == 200, body
    assert [rid for rid, _ in fe.asked] == [body["id"] + f"-{i}" for i in range(3)]
    assert [s.sampling.seed for _, s in fe.asked] == [11, 12, 13] and {s.n for _, s in fe.asked} == {1}
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["Hello wor", " world", "ld sto"]
    assert body["choices"][1]["token_ids"] == [tid(" wor"), tid("ld")]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    # the prompt counted once, the completion tokens of every choice, the cache as choice 0 found it
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert body["prompt_token_ids"] == [5, 6, 7] and fe.closed == ["closed"] * 3


def test_n_choices_stream_carries_each_choices_index():
    fe = PerChoice([])
    (s1, sse), (s2, chat) = _http(fe, [
        lambda c: _post(c, C, {"prompt": "Hi", "n": 2, "stream": True, "stream_options": {"include_usage": True},
                               "return_token_ids": True}),
        lambda c: _post(c, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "stream": True}),
    ])
    assert s1 == s2 == 200
    chunks = chunks_of(sse)
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]) and chunks[-1]["choices"] == []
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i)
             for i in (0, 1)}
    assert texts == {0: "Hello wor", 1: " world"}
    ends = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(e["index"] for e in ends) == [0, 1]
    assert [i for i, c in enumerate(chunks) if "prompt_token_ids" in c] == [0]  # once, on the first chunk
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["usage"]["prompt_tokens"] == 2
    deltas = [c["choices"][0] for c in chunks_of(chat)]
    for i in range(3):
        mine = [d["delta"] for d in deltas if d["index"] == i]
        assert mine[0]["role"] == "assistant" and all("role" not in d for d in mine[1:])
        assert "".join(d["content"] for d in mine) == WORDS[i] + WORDS[i + 1]
    assert len(fe.closed) == 5


def test_a_refused_choice_aborts_the_choices_already_queued():
    aborted: list[str] = []

    class Full(FakeFrontend):
        def generate(self, request_id: str, spec: GenerateSpec) -> Events:
            if len(self.asked) == 2:
                raise ApiError(503, "the server is overloaded", code="server_overloaded",
                               err_type="service_unavailable")
            self.asked.append((request_id, spec))
            return Events(request_id, aborted, tokens("Hello"))

    fe = Full([])
    for stream in (False, True):
        aborted.clear()
        fe.asked.clear()
        (status, body), = _http(fe, [lambda c, s=stream: _post(c, C, {"prompt": [5], "n": 4, "stream": s})])
        assert status == 503 and body["error"]["code"] == "server_overloaded"
        assert aborted == [rid for rid, _ in fe.asked] and len(aborted) == 2


def test_a_failing_choice_fails_the_request_and_aborts_the_others():
    aborted: list[str] = []

    class OneFails(FakeFrontend):
        def generate(self, request_id: str, spec: GenerateSpec) -> Events:
            self.asked.append((request_id, spec))
            if len(self.asked) % 3 == 2:  # choice 1 of each request
                return Events(request_id, aborted, [TokenEvent(None, error="the group went down")])
            return Events(request_id, aborted, [TokenEvent(tid("Hello"))], hang=True)

    fe = OneFails([])
    (s1, whole), (s2, sse) = _http(fe, [lambda c: _post(c, C, {"prompt": [5], "n": 3}),
                                        lambda c: _post(c, C, {"prompt": [5], "n": 3, "stream": True})])
    assert s1 == 503 and whole["error"]["code"] == "group_unavailable"
    assert s2 == 200 and chunks_of(sse)[-1]["error"]["code"] == "group_unavailable"
    failed = {fe.asked[1][0], fe.asked[4][0]}
    assert set(aborted) == {rid for rid, _ in fe.asked} - failed and len(aborted) == 4


@pytest.mark.parametrize("n", [1, 3])  # one choice is read without the task and queue that interleave n
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_aborts_every_choice(stream, n):
    fe = Hanging([TokenEvent(tid("Hello"))])

    async def go() -> list[str]:
        port = _free_port()
        runner = await run_app(OpenAIServer(fe).app(), "127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(asyncio.TimeoutError):
                    async with session.post(f"http://127.0.0.1:{port}{C}", json={
                            "prompt": [5], "n": n, "stream": stream}, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                        await r.read()
            for _ in range(50):
                if len(fe.closed) == n:
                    break
                await asyncio.sleep(0.1)
            return list(fe.closed)
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == ["closed"] * n and len(fe.asked) == n


@pytest.mark.parametrize("n", [1, 2])
def test_interleave_closes_every_choice_it_reads_and_passes_its_error_on(n):
    """Read directly (one choice) or through a queue (several): a reader that stops early closes each choice
    (closing a coordinator's events aborts the request), and a choice's error reaches the reader as it was."""
    closed: list[int] = []

    async def choice(i: int, fail: bool = False) -> AsyncGenerator[TextPiece, None]:
        try:
            yield TextPiece(f"a{i}", [1], None, 0)
            if fail:
                raise ApiError(503, "the group went down", code="group_unavailable")
            yield TextPiece(f"b{i}", [2], None, 0)
            await asyncio.Event().wait()  # runs until it is closed
        finally:
            closed.append(i)

    async def stop_early() -> tuple[int, str, list[int]]:
        pieces = interleave([choice(i) for i in range(n)])
        i, piece = await pieces.__anext__()
        await pieces.aclose()
        return i, piece.text, sorted(closed)  # closed by then, not by the loop's clean-up of forgotten generators

    assert asyncio.run(stop_early()) == (0, "a0", list(range(n)))

    async def read_all() -> tuple[list[str], list[int]]:
        got: list[str] = []
        with pytest.raises(ApiError) as err:
            async for _, piece in interleave([choice(0, fail=True)] + [choice(i) for i in range(1, n)]):
                got.append(piece.text)
        assert err.value.status == 503
        return got, sorted(closed)

    closed.clear()
    got, closed_then = asyncio.run(read_all())
    assert "a0" in got and closed_then == list(range(n))


# ----- echo


def test_echo_puts_the_prompt_before_each_choice():
    fe = PerChoice([])
    prompt_ids = TOK.encode("Hi there")
    (s1, text), (s2, ids), (s3, sse) = _http(fe, [
        lambda c: _post(c, C, {"prompt": "Hi there", "echo": True, "n": 2, "return_token_ids": True}),
        lambda c: _post(c, C, {"prompt": prompt_ids, "echo": True}),
        lambda c: _post(c, C, {"prompt": "Hi there", "echo": True, "stream": True, "n": 2}),
    ])
    assert s1 == s2 == s3 == 200
    assert [c["text"] for c in text["choices"]] == ["Hi thereHello wor", "Hi there world"]
    assert text["choices"][0]["token_ids"] == [tid("Hello"), tid(" wor")]  # vLLM: the generated ids only
    assert text["usage"]["completion_tokens"] == 4 and text["prompt_token_ids"] == prompt_ids
    assert ids["choices"][0]["text"] == TOK.decode(prompt_ids) + "Hello wor"  # the prompt's ids, decoded
    chunks = chunks_of(sse)
    for i, whole in enumerate(["Hi thereHello wor", "Hi there world"]):
        mine = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0].startswith("Hi there") and "".join(mine) == whole


def test_echo_goes_with_logprobs_and_a_wrong_type_is_refused_naming_echo():
    from lockstep.coordinator.openai_fields import check_echo

    assert check_echo({"echo": True}) is True and check_echo({"echo": None}) is False
    assert check_echo({"echo": True, "logprobs": 1}) is True  # the prompt's tokens are scored (test_logprobs.py)
    with pytest.raises(ApiError) as info:
        check_echo({"echo": 1, "logprobs": 1})
    assert (info.value.status, info.value.param) == (400, "echo")


# ----- chat content parts


def test_chat_content_parts_are_joined_and_null_content_is_empty():
    fe = PerChoice([])
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": [], "name": "me"}, {"role": "user"}]
    (status, body), = _http(fe, [lambda c: _post(c, CHAT, {"messages": messages})])
    assert status == 200, body
    assert TOK.decode(fe.asked[0][1].prompt_ids) == "Be/brief|Hi||||"  # vLLM joins text parts with newlines


def test_tokenize_takes_content_parts_too():
    fe = PerChoice([])
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    (s1, parts), (s2, text) = _http(fe, [lambda c: _post(c, "/tokenize", {"messages": messages}),
                                         lambda c: _post(c, "/tokenize", {"messages": [
                                             {"role": "user", "content": "a\nb"}]})])
    assert s1 == s2 == 200 and parts["tokens"] == text["tokens"]
