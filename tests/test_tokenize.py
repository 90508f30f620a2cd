"""vLLM's /tokenize and /detokenize: their request and response shapes, the same field policy and API keys as
/v1/*, and a request schema in /openapi.json that accepts exactly what the server accepts."""

from __future__ import annotations

import asyncio

import pytest
from jsonschema import Draft202012Validator

from lockstep.coordinator.openapi import openapi_document
from test_api_keys import KEYS
from test_generation import TOK, _http, _post, tokens
from test_request_edge import MSG, ChatFrontend

T, D = "/tokenize", "/detokenize"


def _answers(calls: list[tuple[str, object]]) -> list[tuple[int, object]]:
    fe = ChatFrontend(tokens("Hello"))
    out = _http(fe, [lambda c, p=p, b=b: _post(c, p, b) for p, b in calls])
    assert fe.asked == []  # nothing is generated
    return out


def test_tokenize_a_prompt_and_a_chat_and_detokenize_back():
    ids = TOK.encode("Hello world")
    chat_ids = TOK.encode("hi\n", add_special_tokens=False)
    (s1, plain), (s2, strs), (s3, chat), (s4, bare), (s5, text), (s6, empty) = _answers([
        (T, {"prompt": "Hello world", "model": "tiny"}),
        (T, {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}),
        (T, {"messages": MSG, "add_generation_prompt": True}),
        (T, {"messages": MSG, "add_special_tokens": True, "add_generation_prompt": False}),
        (D, {"tokens": ids, "model": "tiny"}),
        (D, {"tokens": []}),
    ])
    assert (s1, s2, s3, s4, s5, s6) == (200,) * 6
    assert plain == {"count": len(ids), "max_model_len": 64, "tokens": ids}  # no token_strs unless asked
    unspecial = TOK.encode("Hello world", add_special_tokens=False)
    assert strs["tokens"] == unspecial and strs["token_strs"] == [TOK._backend.id_to_token(i) for i in unspecial]
    assert [TOK.token_to_id(s) for s in strs["token_strs"]] == unspecial  # the vocabulary's strings
    assert chat["tokens"] == chat_ids and bare["tokens"] == TOK.encode("hi\n")  # chat: no specials by default
    assert text == {"prompt": TOK.decode(ids, skip_special_tokens=False)} and empty == {"prompt": ""}


@pytest.mark.parametrize("path, body, param, words", [
    (T, {}, "prompt", "needs a 'prompt'"),
    (T, {"prompt": [1, 2]}, "prompt", "must be of type string"),
    (T, {"prompt": "x", "messages": MSG}, "prompt", "unsupported field 'prompt'"),
    (T, {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "unsupported field"),
    (T, {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
    (T, {"prompt": "x", "temperature": 0}, "temperature", "unsupported field"),
    (T, {"messages": []}, "messages", "non-empty"),
    (T, {"messages": None}, "messages", "non-empty"),
    (D, {}, "tokens", "list of token ids"),
    (D, {"tokens": [1, "a"]}, "tokens", "list of token ids"),
    (D, {"tokens": [10**9]}, "tokens", "outside the vocabulary"),
    (D, {"tokens": [1e300]}, "tokens", "outside the vocabulary"),  # named cut short, not in 300 digits
    (D, {"tokens": [1], "prompt": "x"}, "prompt", "unsupported field"),
])
def test_bad_tokenize_requests_are_400s_naming_the_field_and_the_document_refuses_them(path, body, param, words):
    (status, answer), = _answers([(path, body)])
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert len(answer["error"]["message"]) < 160, answer
    assert list(_validator(path).iter_errors(body)), body


def test_a_wrong_model_is_a_404():
    (s1, a1), (s2, a2) = _answers([(T, {"prompt": "x", "model": "other"}), (D, {"tokens": [1], "model": "o"})])
    assert (s1, s2) == (404, 404) and a1["error"]["param"] == "model"


@pytest.mark.parametrize("path, body", [
    (T, {"prompt": "x"}), (T, {"prompt": "", "add_special_tokens": None, "model": None}),
    (T, {"messages": MSG, "return_token_strs": False}), (D, {"tokens": [1, 2.0]}),
])
def test_what_the_server_accepts_the_document_accepts(path, body):
    (status, answer), = _answers([(path, body)])
    assert status == 200, answer
    assert not list(_validator(path).iter_errors(body))


def _validator(path: str) -> Draft202012Validator:
    doc = openapi_document("tiny", 64, TOK.vocab_size, "0")
    return Draft202012Validator(doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])


def test_tokenize_and_detokenize_need_the_api_key():
    from aiohttp.test_utils import TestClient, TestServer

    from lockstep.coordinator.openai_api import OpenAIServer

    async def go() -> list[int]:
        async with TestClient(TestServer(OpenAIServer(ChatFrontend([]), KEYS).app())) as client:
            out = []
            for path, body in ((T, {"prompt": "x"}), (D, {"tokens": [1]})):
                for key in (None, "wrong", KEYS[1]):
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    out.append((await client.post(path, json=body, headers=headers)).status)
            return out

    assert asyncio.run(go()) == [401, 401, 200] * 2


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
    (T, lambda text: {"prompt": text}),
])
def test_a_large_prompt_is_tokenized_off_the_event_loop(path, body):
    """Found by a fault-finding helper: tokenizing a prompt of a few MB held the event loop for seconds (six of
    them stalled another client's stream 9.7 s, and the step loop shares that loop). The tokenizer's batch call
    releases the GIL, so a large text is encoded in a thread while the loop goes on."""
    import time

    from aiohttp.test_utils import TestClient, TestServer

    from lockstep.coordinator.openai_api import OpenAIServer

    text = "hello world " * 300_000  # within the 4 MB body limit
    started = time.perf_counter()
    TOK.encode(text)
    alone = time.perf_counter() - started
    assert alone > 0.3, "this machine encodes too fast for the test to tell a stall from none"

    async def go() -> tuple[int, float]:
        async with TestClient(TestServer(OpenAIServer(ChatFrontend(tokens("Hello"))).app())) as client:
            loop, gaps, done = asyncio.get_running_loop(), [0.0], asyncio.Event()

            async def tick() -> None:
                last = loop.time()
                while not done.is_set():
                    await asyncio.sleep(0.005)
                    gaps.append(loop.time() - last)
                    last = loop.time()

            ticker = asyncio.create_task(tick())
            status, _ = await _post(client, path, {**body(text), "model": "tiny"})
            done.set()
            await ticker
            return status, max(gaps)

    status, longest = asyncio.run(go())
    assert status in (200, 400)  # 400: longer than the fake model's context, found once tokenized
    assert longest < max(alone / 4, 0.25), (longest, alone)  # the loop ran on: ticks every few ms, not seconds


def test_a_long_list_of_ids_is_detokenized_off_the_event_loop(monkeypatch):
    """Found by a fault-finding helper: /detokenize parsed, checked and decoded its ids on the event loop. A body
    of 4 MB holds 2 million ids, a second and a half of work: six such calls at once stalled another client's
    stream for 6.7 s on the built-in model (and in one process the step loop shares that loop), as /tokenize's
    large texts did before they went to a thread. A large body is now parsed there, and a long list checked and
    decoded there, with the backend's batch call, which releases the GIL; the answer is the same."""
    from lockstep.coordinator import openai_api
    from lockstep.coordinator.prompt_encoding import OFF_LOOP_CHARS
    from lockstep.tokenizer import Tokenizer

    on_loop: list[bool] = []
    parsed_on_loop: list[bool] = []
    load_body = openai_api.load_body

    def recording_load_body(raw: bytes) -> dict:
        parsed_on_loop.append(running_loop())
        return load_body(raw)

    monkeypatch.setattr(openai_api, "load_body", recording_load_body)

    def running_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    class Recording(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            on_loop.append(running_loop())
            return super().decode(ids, skip_special_tokens)

        def decode_unlocked(self, ids, skip_special_tokens=True):
            on_loop.append(running_loop())
            return super().decode_unlocked(ids, skip_special_tokens)

    class Frontend(ChatFrontend):
        tokenizer = Recording(TOK._backend, {}, None, {0})

    ids = TOK.encode("Hello world")
    many = ids * (OFF_LOOP_CHARS // len(ids) + 1)
    fe = Frontend(tokens("Hello"))
    (s1, short), (s2, long), (s3, bad) = _http(fe, [lambda c: _post(c, D, {"tokens": ids}),
                                                    lambda c: _post(c, D, {"tokens": many}),
                                                    lambda c: _post(c, D, {"tokens": [*many, 10**9]})])
    assert (s1, s2, s3) == (200, 200, 400)
    assert short == {"prompt": TOK.decode(ids, False)} and long == {"prompt": TOK.decode(many, False)}
    assert bad["error"]["param"] == "tokens" and "outside the vocabulary" in bad["error"]["message"]
    assert on_loop[0] is True and on_loop[1:] == [False, False]  # a short list decodes at once; long ones in a thread
    assert parsed_on_loop == [True, False, False]  # and so is a body parsed
