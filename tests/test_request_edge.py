"""No request content breaks the HTTP API: every field is checked at the edge into a 4xx OpenAI error body.

Over the fake frontend of test_generation.py, in process: Python's JSON literals that are not JSON
(NaN, Infinity), numbers no field can hold, deep nesting, wrong types, unsupported fields, oversized
bodies, a sampled id past the tokenizer's vocabulary, and clients that hang up before their answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncGenerator

import aiohttp
import pytest

from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.openai_fields import MAX_BODY_BYTES, MAX_JSON_DEPTH
from lockstep.coordinator.request import FinishReason
from lockstep.tokenizer import Tokenizer
from test_generation import TOK, FakeFrontend, _http, _post, grpc_spec, tid, tokens

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_PROMPT = {"prompt": [5, 6]}
MSG = [{"role": "user", "content": "hi"}]


class ChatFrontend(FakeFrontend):
    tokenizer = Tokenizer(TOK._backend, {}, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", {0})


def raw(text: str) -> bytes:
    return text.encode()


# (path, body, status, param or None, words in the message)
REFUSED = [
    (C, raw('{"prompt": "x", "temperature": NaN}'), 400, None, "NaN is not a JSON number"),
    (C, raw('{"prompt": "x", "top_p": Infinity}'), 400, None, "Infinity is not a JSON number"),
    (C, raw('{"prompt": "x", "temperature": -Infinity}'), 400, None, "-Infinity is not a JSON number"),
    (C, raw('{"prompt": "x", "temperature": 1e999}'), 400, None, "does not fit a 64-bit float"),
    (C, raw('{"prompt": "x", "seed": ' + "9" * 5000 + "}"), 400, None, "not valid JSON"),
    (C, raw('{"prompt": ' + "[" * 10000 + "]" * 10000 + "}"), 400, None, "nested deeper"),
    (C, raw('{"prompt": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"), 400, None, "nested deeper"),
    (C, raw('{"prompt": "a\\ud800b"}'), 400, None, "surrogate"),
    (C, b'{"prompt": "\xff"}', 400, None, "not valid JSON"),
    (C, raw("[1, 2]"), 400, None, "must be a JSON object"),
    (C, raw(""), 400, None, "not valid JSON"),
    (C, {**OK_PROMPT, "max_tokens": 10**30}, 400, "max_tokens", "context length"),
    (C, {**OK_PROMPT, "max_tokens": True}, 400, "max_tokens", "got a boolean"),
    (C, {**OK_PROMPT, "max_tokens": "5"}, 400, "max_tokens", "got str"),
    (C, {**OK_PROMPT, "max_tokens": 2.5}, 400, "max_tokens", "got float"),
    (C, {**OK_PROMPT, "max_tokens": 3, "max_completion_tokens": 999}, 400, "max_completion_tokens", "between 1"),
    (C, {**OK_PROMPT, "top_k": 2**70}, 400, "top_k", "up to 2147483647"),
    (C, {**OK_PROMPT, "seed": 2**63}, 400, "seed", "64-bit"),
    (C, {**OK_PROMPT, "temperature": 10**400}, 400, "temperature", "out of range"),
    (C, {**OK_PROMPT, "temperature": "0.5"}, 400, "temperature", "got str"),
    (C, {"prompt": [1, 10**30]}, 400, "prompt", "token ids must be in"),
    (C, {"prompt": [1, TOK.vocab_size]}, 400, "prompt", "token ids must be in"),
    (C, {"prompt": [1, True]}, 400, "prompt", "list of token ids"),
    (C, {"prompt": [[1], [2]]}, 400, "prompt", "list of token ids"),
    (C, {"prompt": None}, 400, "prompt", "list of token ids"),
    (C, {**OK_PROMPT, "n": 17}, 400, "n", "between 1 and 16"),
    (C, {**OK_PROMPT, "n": 0}, 400, "n", "between 1 and 16"),
    (C, {**OK_PROMPT, "use_beam_search": True}, 400, "use_beam_search", "accepted only as null or false"),
    (C, {**OK_PROMPT, "stop_token_ids": [TOK.vocab_size]}, 400, "stop_token_ids", "token ids in [0,"),
    (C, {**OK_PROMPT, "stop_token_ids": [-1]}, 400, "stop_token_ids", "token ids in [0,"),
    (C, {**OK_PROMPT, "stop_token_ids": "5"}, 400, "stop_token_ids", "type array"),
    (C, {**OK_PROMPT, "stop": ["a"] * 5}, 400, "stop", "up to 4"),
    (C, {**OK_PROMPT, "stop": "x" * 257}, 400, "stop", "at most 256 characters"),
    (C, {**OK_PROMPT, "foo": 1}, 400, "foo", "unsupported field 'foo'"),
    (C, {**OK_PROMPT, "messages": MSG}, 400, "messages", "unsupported field"),
    (C, {**OK_PROMPT, "frequency_penalty": 2.5}, 400, "frequency_penalty", "must be in [-2, 2], got 2.5"),
    (C, {**OK_PROMPT, "frequency_penalty": False}, 400, "frequency_penalty", "must be of type integer or number"),
    (C, {**OK_PROMPT, "frequency_penalty": "1"}, 400, "frequency_penalty", "must be of type integer or number"),
    (C, {**OK_PROMPT, "presence_penalty": -2.01}, 400, "presence_penalty", "must be in [-2, 2]"),
    (C, {**OK_PROMPT, "presence_penalty": 10**400}, 400, "presence_penalty", "out of range"),
    (C, {**OK_PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty", "must be > 0"),
    (C, {**OK_PROMPT, "repetition_penalty": -1.5}, 400, "repetition_penalty", "must be > 0"),
    (C, {**OK_PROMPT, "repetition_penalty": [1]}, 400, "repetition_penalty", "must be of type integer or number"),
    (C, raw('{"prompt": [5], "repetition_penalty": NaN}'), 400, None, "not valid JSON"),
    (C, {**OK_PROMPT, "min_tokens": -1}, 400, "min_tokens", "at least 0"),
    (C, {**OK_PROMPT, "min_tokens": 1.5}, 400, "min_tokens", "must be of type integer"),
    (C, {**OK_PROMPT, "logit_bias": {"5": 101}}, 400, "logit_bias", "between -100 and 100, got 101"),
    (C, {**OK_PROMPT, "logit_bias": {"5": -100.5}}, 400, "logit_bias", "between -100 and 100"),
    (C, {**OK_PROMPT, "logit_bias": {"5": "1"}}, 400, "logit_bias", "values must be numbers, got str"),
    (C, {**OK_PROMPT, "logit_bias": {"5": True}}, 400, "logit_bias", "values must be numbers, got bool"),
    (C, {**OK_PROMPT, "logit_bias": {"5": None}}, 400, "logit_bias", "values must be numbers"),
    (C, {**OK_PROMPT, "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids in decimal, got 'a'"),
    (C, {**OK_PROMPT, "logit_bias": {"-1": 1}}, 400, "logit_bias", "token ids in decimal"),
    (C, {**OK_PROMPT, "logit_bias": {"05": 1}}, 400, "logit_bias", "token ids in decimal"),
    (C, {**OK_PROMPT, "logit_bias": {" 5": 1}}, 400, "logit_bias", "token ids in decimal"),
    (C, {**OK_PROMPT, "logit_bias": {"1" + "0" * 30: 1}}, 400, "logit_bias", "token ids in decimal"),
    (C, {**OK_PROMPT, "logit_bias": {str(TOK.vocab_size): 1}}, 400, "logit_bias", f"in [0, {TOK.vocab_size})"),
    (C, {**OK_PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", "at most 300 entries"),
    (C, {**OK_PROMPT, "logit_bias": [[5, 1]]}, 400, "logit_bias", "must be of type object"),
    (C, {**OK_PROMPT, "logprobs": 21}, 400, "logprobs", "between 0 and 20, got 21"),
    (C, {**OK_PROMPT, "logprobs": -1}, 400, "logprobs", "between 0 and 20, got -1"),
    (C, {**OK_PROMPT, "logprobs": True}, 400, "logprobs", "got a boolean"),
    (C, {**OK_PROMPT, "logprobs": 1.5}, 400, "logprobs", "type integer"),
    (C, {**OK_PROMPT, "logprobs": 21, "echo": True}, 400, "logprobs", "between 0 and 20, got 21"),
    (C, {**OK_PROMPT, "logprobs": 1, "echo": False, "max_tokens": 0}, 400, "max_tokens", "0 only with echo"),
    (C, {**OK_PROMPT, "echo": True, "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    (C, {**OK_PROMPT, "max_tokens": 5, "max_completion_tokens": 0}, 400, "max_completion_tokens", "between 1"),
    (C, {**OK_PROMPT, "logprobs": 1, "echo": "yes"}, 400, "echo", "type boolean"),
    (C, {**OK_PROMPT, "top_logprobs": 2}, 400, "top_logprobs", "unsupported field"),
    (C, {**OK_PROMPT, "prompt_logprobs": 21}, 400, "prompt_logprobs", "between 0 and 20, got 21"),
    (C, {**OK_PROMPT, "prompt_logprobs": True}, 400, "prompt_logprobs", "got a boolean"),
    (C, {**OK_PROMPT, "echo": 1}, 400, "echo", "type boolean, got int"),
    (C, {**OK_PROMPT, "best_of": 2}, 400, "best_of", "accepted only"),
    (C, {**OK_PROMPT, "user": 5}, 400, "user", "string"),
    (C, {**OK_PROMPT, "user": "u" * 257}, 400, "user", "at most 256"),
    (C, {**OK_PROMPT, "stream": True, "stream_options": {"include_usage": True, "foo": 1}}, 400,
     "stream_options.foo", "unsupported"),
    (C, {**OK_PROMPT, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "boolean"),
    # OpenAI and vLLM refuse options for a stream that is not asked for (the usage chunk would never come)
    (C, {**OK_PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options", "only when 'stream' is true"),
    (C, {**OK_PROMPT, "stream": False, "stream_options": {"include_usage": False}}, 400, "stream_options", "only when"),
    (C, {**OK_PROMPT, "stream_options": []}, 400, "stream_options", "object"),
    (C, {**OK_PROMPT, "model": 5}, 400, "model", "string"),
    (CHAT, {"messages": MSG, "logprobs": 1}, 400, "logprobs", "type boolean, got int"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "between 0 and 20"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "between 0 and 20"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "needs 'logprobs': true"),
    (CHAT, {"messages": MSG, "logprobs": False, "top_logprobs": 3}, 400, "top_logprobs", "needs 'logprobs': true"),
    (CHAT, {"messages": MSG, "prompt_logprobs": 1}, 400, "prompt_logprobs", "unsupported field"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", "accepted only"),
    (CHAT, {"messages": MSG, "prompt": "x"}, 400, "prompt", "unsupported field"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": [{}]}]}, 400, "messages",
     "messages[0].tool_calls"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {
        "type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages",
     "unsupported content part type 'image_url' at messages[0].content[1]"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400,
     "messages", "unsupported content part type 'input_audio'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages",
     "messages[0].content[0].text must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": {}}]}]}, 400,
     "messages", "unsupported field 'messages[0].content[0].cache'"),
    (CHAT, {"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages", "string 'type'"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "array of content parts"),
    (CHAT, {"messages": [{"role": "user", "content": {"type": "text", "text": "x"}}]}, 400, "messages",
     "array of content parts"),
    (CHAT, {"messages": [{"role": 1, "content": "hi"}]}, 400, "messages", "string 'role'"),
    (CHAT, {"messages": []}, 400, "messages", "non-empty"),
]


@pytest.mark.parametrize("path, body, status, param, words", REFUSED)
def test_bad_requests_are_4xx_openai_errors_that_name_the_field(path, body, status, param, words):
    fe = FakeFrontend(tokens("Hello"))
    (got, answer), = _http(fe, [lambda c: _post(c, path, body)])
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert fe.asked == []  # nothing reached the coordinator


# refusals no JSON schema can state (one field against another): /openapi.json accepts these bodies
REFUSED_BEYOND_THE_SCHEMA = [
    (C, {**OK_PROMPT, "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens", "must not exceed 'max_tokens' (4)"),
    (C, {**OK_PROMPT, "min_tokens": 3, "max_completion_tokens": 2}, 400, "min_tokens", "must not exceed"),
]


@pytest.mark.parametrize("path, body, status, param, words", REFUSED_BEYOND_THE_SCHEMA)
def test_min_tokens_over_max_tokens_is_a_400_naming_min_tokens(path, body, status, param, words):
    test_bad_requests_are_4xx_openai_errors_that_name_the_field(path, body, status, param, words)


def test_penalty_fields_reach_the_spec():
    fe = ChatFrontend(tokens("Hello"))
    body = {**OK_PROMPT, "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.3, "min_tokens": 2,
            "max_tokens": 4, "logit_bias": {"9": 3, "2": -100}}
    (got, answer), = _http(fe, [lambda c: _post(c, C, body)])
    assert got == 200, answer
    (_, spec), = fe.asked
    p = spec.sampling
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_tokens) == (0.5, -1.0, 1.3, 2)
    assert p.logit_bias == ((2, -100.0), (9, 3.0))
    (got, answer), = _http(fe, [lambda c: _post(c, C, {**OK_PROMPT, "min_tokens": 10**6})])
    assert got == 200 and fe.asked[-1][1].sampling.min_tokens == fe.asked[-1][1].max_tokens  # up to the context


def test_max_logprobs_is_the_servers_setting():
    from lockstep.coordinator.config import parse_config
    from lockstep.coordinator.openai_fields import check_fields

    assert parse_config(["--group", "g=h:1"], {}).max_logprobs == 20
    assert parse_config(["--group", "g=h:1"], {"LOCKSTEP_MAX_LOGPROBS": "5"}).max_logprobs == 5
    assert parse_config(["--group", "g=h:1", "--max-logprobs", "0"], {}).max_logprobs == 0
    check_fields({"prompt": "x", "logprobs": 5, "prompt_logprobs": 5}, "completions", 5)
    for body, endpoint, name in (({"prompt": "x", "logprobs": 6}, "completions", "logprobs"),
                                 ({"prompt": "x", "prompt_logprobs": 6}, "completions", "prompt_logprobs"),
                                 ({"messages": MSG, "logprobs": True, "top_logprobs": 6}, "chat", "top_logprobs")):
        with pytest.raises(ApiError) as err:
            check_fields(body, endpoint, 5)
        assert err.value.param == name and "between 0 and 5" in err.value.message
        assert "--max-logprobs" in err.value.message


ACCEPTED = [
    (C, {**OK_PROMPT, "stop": []}),
    (C, {**OK_PROMPT, "max_tokens": 8.0, "top_k": 3.0}),
    (C, {"prompt": [5.0, 6], "user": "me", "model": "tiny"}),
    (C, {**OK_PROMPT, "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": None, "echo": False,
         "best_of": 1, "logit_bias": {}, "suffix": None, "repetition_penalty": 1, "stop_token_ids": [],
         "use_beam_search": False}),
    (C, {**OK_PROMPT, "echo": True, "stop_token_ids": [3, 4.0], "include_stop_str_in_output": True, "n": 1}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b",
                                                                                       "x": None}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": []}],
            "stop_token_ids": [7], "include_stop_str_in_output": False, "ignore_eos": True}),
    (C, {**OK_PROMPT, "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": False}}),
    (C, {**OK_PROMPT, "stream": False, "stream_options": None}),
    (C, {**OK_PROMPT, "stream_options": {}}),  # asks for nothing (vLLM accepts it too)
    (CHAT, {"messages": MSG, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": True, "store": False}),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "a", "tool_calls": None}],
            "max_completion_tokens": 3}),
    (C, {**OK_PROMPT, "logprobs": 0}),
    (C, {**OK_PROMPT, "logprobs": 2, "echo": True}),
    (C, {**OK_PROMPT, "prompt_logprobs": 0, "stream": True}),
    (C, {**OK_PROMPT, "prompt_logprobs": 20, "logprobs": 1, "echo": True}),
    (C, {**OK_PROMPT, "logprobs": 0, "echo": True, "stream": True}),
    (C, {**OK_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}),  # vLLM's echo without generation
    (C, {**OK_PROMPT, "max_completion_tokens": 0.0, "echo": True, "stream": True}),
    (C, {**OK_PROMPT, "logprobs": 20.0, "stream": True}),
    (CHAT, {"messages": MSG, "logprobs": True}),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 20, "stream": True}),
    (CHAT, {"messages": MSG, "logprobs": None, "top_logprobs": None}),
    (C, {**OK_PROMPT, "frequency_penalty": -2, "presence_penalty": 2.0, "repetition_penalty": 1e-3, "min_tokens": 3,
         "max_tokens": 3, "logit_bias": {"0": -100, str(TOK.vocab_size - 1): 100.0, "7": 0.25}}),
    (CHAT, {"messages": MSG, "repetition_penalty": 1e300, "min_tokens": 0, "logit_bias": None,
            "frequency_penalty": None}),
    (C, {**OK_PROMPT, "logit_bias": {str(i): 1 for i in range(min(300, TOK.vocab_size))}, "min_tokens": 10**6}),
]


@pytest.mark.parametrize("path, body", ACCEPTED)
def test_implemented_fields_and_no_op_values_are_accepted(path, body):
    fe = ChatFrontend(tokens("Hello"))
    (got, answer), = _http(fe, [lambda c: _post(c, path, body)])
    assert got == 200, answer
    assert len(fe.asked) == 1


def test_a_body_over_the_limit_is_a_413_with_the_openai_body():
    fe = FakeFrontend(tokens("Hello"))
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()
    (got, answer), = _http(fe, [lambda c: _post(c, C, big)])
    assert got == 413 and answer["error"]["type"] == "invalid_request_error"
    assert str(MAX_BODY_BYTES) in answer["error"]["message"] and fe.asked == []


def test_a_body_that_does_not_decode_as_its_content_encoding_is_a_400_not_a_500(caplog):
    """Found by a fault-finding helper: a body sent with `Content-Encoding: gzip` that is not gzip (a client that
    sets the header and forgets to compress) was a 500 "internal error", logged at ERROR twice with a traceback
    (by the API, then by aiohttp draining the body): a client's mistake paged whoever watches the errors. Now a
    400 with OpenAI's body that says why, and one WARNING line."""
    import gzip
    import logging

    fe = FakeFrontend(tokens("Hello"))
    sent = json.dumps(OK_PROMPT).encode()

    async def post(c, data):
        resp = await c.post(C, data=data, headers={"Content-Encoding": "gzip"})
        return resp.status, await resp.json()

    with caplog.at_level(logging.INFO):
        (bad, answer), (good, _) = _http(fe, [lambda c: post(c, sent), lambda c: post(c, gzip.compress(sent))])
    assert bad == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert "content-encoding" in answer["error"]["message"].lower()
    assert good == 200 and len(fe.asked) == 1  # a body that is gzip still reads
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert all(r.exc_info is None for r in caplog.records if r.name == "aiohttp.server")


def test_a_long_prompt_of_token_ids_is_checked_off_the_event_loop(monkeypatch):
    """Found by a fault-finding helper: a /v1/completions prompt of 2 million token ids (a 4 MB body) had each id
    checked, converted and range-checked on the event loop before it was found longer than the context: six such
    requests at once stalled another client's stream for 4.6 s on the built-in model (and in one process the step
    loop shares that loop). A long list is now checked in the prompt thread, as a long text is encoded, and the
    context length is checked before each id's range."""
    from lockstep.coordinator import openai_api
    from lockstep.coordinator.prompt_encoding import OFF_LOOP_CHARS

    on_loop: list[bool] = []
    check = openai_api.is_json_integer

    def recording(value: object) -> bool:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return check(value)

    monkeypatch.setattr(openai_api, "is_json_integer", recording)
    fe = FakeFrontend(tokens("Hello"))
    long = [5] * (OFF_LOOP_CHARS + 1)
    (s1, _), (s2, too_long), (s3, not_ids) = _http(fe, [lambda c: _post(c, C, OK_PROMPT),
                                                        lambda c: _post(c, C, {"prompt": long}),
                                                        lambda c: _post(c, C, {"prompt": [*long, "x"]})])
    assert (s1, s2, s3) == (200, 400, 400) and len(fe.asked) == 1
    assert too_long["error"]["code"] == "context_length_exceeded"
    assert not_ids["error"]["param"] == "prompt" and "list of token ids" in not_ids["error"]["message"]
    assert on_loop[:2] == [True, True] and set(on_loop[2:]) == {False}  # a short prompt at once; long ones in a thread


def test_too_many_stop_token_ids_are_refused_before_each_is_checked(monkeypatch):
    """Found by a fault-finding helper: `stop_token_ids` may hold 128 ids, but a 4 MB body of 1.5 million had each
    checked and converted on the event loop before their count was: six such requests at once stalled another
    client's stream for 3.7 s on the built-in model. Only one past the limit is looked at: the count refuses it."""
    from lockstep.coordinator import generation

    checked: list[object] = []
    check = generation.is_json_integer

    def counting(value: object) -> bool:
        checked.append(value)
        return check(value)

    monkeypatch.setattr(generation, "is_json_integer", counting)
    fe = FakeFrontend(tokens("Hello"))
    (s1, _), (s2, refused) = _http(fe, [lambda c: _post(c, C, {**OK_PROMPT, "stop_token_ids": [7] * 128}),
                                        lambda c: _post(c, C, {**OK_PROMPT, "stop_token_ids": [7] * 100_000})])
    assert (s1, s2) == (200, 400) and refused["error"]["param"] == "stop_token_ids"
    assert "at most 128" in refused["error"]["message"]
    assert len(checked) == 128 + 129  # the 128 of the first request; of the 100000, one past the limit


def test_a_logit_bias_of_too_many_entries_is_refused_before_each_is_checked(monkeypatch):
    """Found by a fault-finding helper: `logit_bias` may hold 300 entries, but one of 200000 (a 2 MB body) had
    every key matched and every value converted on the event loop before their count was checked: six such
    requests at once stalled another client's stream for 2.0 s on the built-in model. The count refuses it first,
    with the same 400."""
    from lockstep.coordinator import generation

    converted: list[object] = []
    real = generation._real

    def counting(value, default, name):
        converted.append(value)
        return real(value, default, name)

    monkeypatch.setattr(generation, "_real", counting)
    fe = FakeFrontend(tokens("Hello"))
    small, large = ({str(i): 1 for i in range(n)} for n in (5, 100_000))
    (s1, _), (s2, refused) = _http(fe, [lambda c: _post(c, C, {**OK_PROMPT, "logit_bias": small}),
                                        lambda c: _post(c, C, {**OK_PROMPT, "logit_bias": large})])
    assert (s1, s2) == (200, 400) and refused["error"]["param"] == "logit_bias"
    assert "at most 300 entries, got 100000" in refused["error"]["message"]
    assert converted.count(1) == 5  # the small one's entries; none of the large one's


def test_query_parameters_are_checked_like_fields():
    fe = FakeFrontend([])

    async def get(c, path):
        resp = await c.get(path)
        return resp.status, (await resp.json())["error"]["param"] if resp.status != 200 else None

    got = _http(fe, [
        lambda c: get(c, "/admin/steps?foo=1"),
        lambda c: get(c, "/health?x=1"),
        lambda c: get(c, "/admin/steps?since=1_0"),
        lambda c: get(c, "/admin/steps?since=%201"),
        lambda c: get(c, "/admin/steps?since=" + "9" * 30),
        lambda c: _post(c, "/admin/reset_prefix_cache?rank=-1", {}),
        lambda c: _post(c, "/admin/reset_prefix_cache", {"rank": -1}),
        lambda c: _post(c, "/admin/reset_prefix_cache", {"rank": "1"}),
        lambda c: _post(c, "/admin/reset_prefix_cache", {"ranks": 1}),
        lambda c: _post(c, "/admin/reset_prefix_cache?rank=0", {"rank": -1}),
        lambda c: _post(c, "/admin/reset_prefix_cache?rank=0", {"rank": 1}),
        lambda c: _post(c, "/admin/reset_prefix_cache", {"rank": 0}),
        lambda c: get(c, "/admin/steps?since=1"),
    ])
    assert [s for s, _ in got] == [400] * 11 + [200, 200]
    assert [p if isinstance(p, str) or p is None else p["error"]["param"] for _, p in got[:11]] == [
        "foo", "x", "since", "since", "since", "rank", "rank", "rank", "ranks", "rank", "rank"]


def test_a_wrong_method_is_a_405_with_allow_and_an_error_body():
    async def call(c):
        resp = await c.get(C)
        return resp.status, resp.headers.get("Allow"), await resp.json()

    (status, allow, body), = _http(FakeFrontend([]), [call])
    assert status == 405 and allow == "POST" and body["error"]["type"] == "invalid_request_error"


def test_an_internal_error_is_a_500_with_the_openai_body():
    class Broken(FakeFrontend):
        def health_detail(self) -> dict:
            raise RuntimeError("bug")

    async def call(c):
        resp = await c.get("/health")
        return resp.status, await resp.json()

    (status, body), = _http(Broken([]), [call])
    assert status == 500 and body["error"]["type"] == "server_error" and "bug" not in body["error"]["message"]


def test_version():
    import lockstep

    async def call(c):
        resp = await c.get("/version")
        return resp.status, await resp.json()

    assert _http(FakeFrontend([]), [call]) == [(200, {"version": lockstep.__version__})]


# ----- output past the tokenizer's vocabulary


def test_a_sampled_id_past_the_tokenizers_vocabulary_reads_as_nothing():
    """A model whose embedding is padded can sample an id the tokenizer has no text for: it was a
    ValueError from the decoder inside the response (a 500, or a broken stream)."""
    past = TOK.vocab_size + 5
    fe = FakeFrontend([TokenEvent(tid("Hello")), TokenEvent(past), TokenEvent(tid(" wor")),
                       TokenEvent(None, FinishReason.LENGTH)])
    (s1, whole), (s2, sse) = _http(fe, [
        lambda c: _post(c, C, {**OK_PROMPT, "return_token_ids": True}),
        lambda c: _post(c, C, {**OK_PROMPT, "stream": True, "return_token_ids": True}),
    ])
    assert s1 == 200 and whole["choices"][0]["text"] == "Hello wor"
    assert whole["choices"][0]["token_ids"] == [tid("Hello"), past, tid(" wor")]
    chunks = [json.loads(line[6:]) for line in sse.split("\n") if line.startswith("data: {")]
    assert s2 == 200 and "".join(c["choices"][0]["text"] for c in chunks) == "Hello wor"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [tid("Hello"), past, tid(" wor")]


def test_an_internal_error_inside_a_stream_ends_it_with_an_error_event():
    """Once the 200 went out, a bug can only be reported in the stream; it used to leave the client waiting."""

    class Failing(FakeFrontend):
        def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
            async def events() -> AsyncGenerator[TokenEvent, None]:
                yield TokenEvent(tid("Hello"))
                raise RuntimeError("bug")

            return events()

    (status, sse), = _http(Failing([]), [lambda c: _post(c, C, {**OK_PROMPT, "stream": True})])
    events = [json.loads(line[6:]) for line in sse.split("\n") if line.startswith("data: {")]
    assert status == 200 and sse.rstrip().endswith("data: [DONE]")
    assert events[0]["choices"][0]["text"] == "Hello" and events[-1]["error"]["type"] == "server_error"


# ----- clients that hang up


class Hanging(FakeFrontend):
    """A request that never ends (it waits in the queue, or the group is slow); records its abort."""

    def __init__(self, first: list[TokenEvent]) -> None:
        super().__init__(first)
        self.started = asyncio.Event()

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
        self.asked.append((request_id, spec))

        async def events() -> AsyncGenerator[TokenEvent, None]:
            try:
                self.started.set()
                for ev in self.events:
                    yield ev
                await asyncio.Event().wait()
                yield TokenEvent(None, FinishReason.LENGTH)  # pragma: no cover
            finally:
                self.closed.append("closed")

        return events()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stream, first", [(False, []), (False, [TokenEvent(5)]), (True, [])])
def test_a_client_that_hangs_up_aborts_its_request(stream, first):
    """Served as `lockstep coordinator` serves (run_app, no handler cancellation): a non-streaming client
    that hangs up, or a streaming one before its first token, had its request run to the end."""
    fe = Hanging(first)

    async def go() -> list[str]:
        port = _free_port()
        runner = await run_app(OpenAIServer(fe).app(), "127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(asyncio.TimeoutError):
                    async with session.post(f"http://127.0.0.1:{port}{C}", json={**OK_PROMPT, "stream": stream},
                                            timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
                        await resp.read()
            for _ in range(50):
                if fe.closed:
                    break
                await asyncio.sleep(0.1)
            return list(fe.closed)  # before cleanup, which cancels every handler left
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == ["closed"]
    assert len(fe.asked) == 1


def test_idle_and_half_sent_connections_are_closed_after_the_keep_alive_but_a_long_request_is_not():
    """aiohttp's default kept an idle connection, or one that never finished its headers, open for 75 s: a few
    hundred such clients held their sockets that long. A request still running past the keep-alive is not cut."""
    fe = Hanging([TokenEvent(5)])

    async def closed_after(port: int, sent: bytes) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = asyncio.get_running_loop().time()
        writer.write(sent)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, with nothing said
        writer.close()
        return asyncio.get_running_loop().time() - t0

    async def go() -> tuple[float, float, list[str]]:
        port = _free_port()
        runner = await run_app(OpenAIServer(fe).app(), "127.0.0.1", port, keep_alive=0.5)
        try:
            idle = await closed_after(port, b"")
            half = await closed_after(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            chunks = []
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}{C}", json={**OK_PROMPT, "stream": True}) as resp:
                    await asyncio.sleep(1.5)  # three keep-alives while the request runs
                    chunks.append(await resp.content.readuntil(b"\n\n"))
            return idle, half, chunks
        finally:
            await runner.cleanup()

    idle, half, chunks = asyncio.run(go())
    assert 0.4 < idle < 3 and 0.4 < half < 3
    assert chunks[0].startswith(b"data: {")
    from lockstep.coordinator.config import parse_config

    env = {"LOCKSTEP_GROUPS": "g0=a:1"}
    assert parse_config([], env).http_keep_alive == 5.0  # uvicorn's default, as vLLM serves
    assert parse_config(["--timeout-keep-alive", "65"], env).http_keep_alive == 65.0
    with pytest.raises(SystemExit):
        parse_config(["--timeout-keep-alive", "0"], env)


def test_grpc_requests_have_the_same_limits():
    from lockstep.coordinator.grpc_api import MAX_REQUEST_ID_CHARS
    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    fe = FakeFrontend([])
    ids = ipb.TokenIds(ids=[5, 6])
    for req, param in ((ipb.GenerateRequest(token_ids=ids, request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), "request_id"),
                       (ipb.GenerateRequest(token_ids=ids, stop=["x" * 257]), "stop"),
                       (ipb.GenerateRequest(token_ids=ids, top_k=2**40), "top_k"),
                       (ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 2**62])), "prompt"),
                       (ipb.GenerateRequest(token_ids=ids, max_tokens=2**62), "max_tokens")):
        with pytest.raises(ApiError) as info:
            grpc_spec(fe, req)
        assert (info.value.status, info.value.param) == (400, param)
    assert grpc_spec(fe, ipb.GenerateRequest(token_ids=ids, request_id="r" * MAX_REQUEST_ID_CHARS))[1] == "r" * 256


@pytest.mark.parametrize("retry_after, header", [(None, "5"), (12.3, "13"), (0.01, "1")])
def test_a_503_says_when_to_retry(retry_after, header):
    class Down(FakeFrontend):
        def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
            raise ApiError(503, "no group can serve now", code="group_unavailable", err_type="service_unavailable",
                           retry_after=retry_after)

    async def call(c):
        resp = await c.post(C, json=OK_PROMPT)
        return resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"]["code"]

    assert _http(Down([]), [call]) == [(503, header, "group_unavailable")]
    assert ApiError(400, "x").headers() == {}


def test_grpc_penalty_fields_are_checked_as_the_http_ones():
    import math

    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb

    spec, _ = grpc_spec(FakeFrontend([]), ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=[5, 6]), max_tokens=4, repetition_penalty=1.2, frequency_penalty=0.5,
        presence_penalty=-0.5, min_tokens=2, logit_bias={7: 5.0, 3: -1.0}))
    p = spec.sampling
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_tokens) == (1.2, 0.5, -0.5, 2)
    assert p.logit_bias == ((3, -1.0), (7, 5.0))
    unset, _ = grpc_spec(FakeFrontend([]), ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5])))
    assert not unset.sampling.adjusts_logits
    for fields, param in (({"repetition_penalty": 0.0}, "repetition_penalty"),
                          ({"frequency_penalty": math.nan}, "frequency_penalty"),
                          ({"presence_penalty": -3.0}, "presence_penalty"),
                          ({"min_tokens": 5}, "min_tokens"),
                          ({"logit_bias": {-1: 1.0}}, "logit_bias"),
                          ({"logit_bias": {TOK.vocab_size: 1.0}}, "logit_bias"),
                          ({"logit_bias": {1: math.inf}}, "logit_bias"),
                          ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
                          ({"logprobs": 21}, "logprobs")):
        with pytest.raises(ApiError) as err:
            grpc_spec(FakeFrontend([]), ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5]), max_tokens=4,
                                                               **fields))
        assert err.value.status == 400 and err.value.param == param, fields

    class Limited(FakeFrontend):
        max_logprobs = 3  # the coordinator's --max-logprobs, as the frontend tells it

    with pytest.raises(ApiError) as err:
        grpc_spec(Limited([]), ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5]), logprobs=4))
    assert "between 0 and 3" in err.value.message


def test_openapi_documents_the_penalty_ranges_and_the_servers_max_logprobs():
    import re

    from lockstep.coordinator.openapi import openapi_document, request_schema

    doc = openapi_document("tiny", 64, 300, "0", max_logprobs=5)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = {name: schema["anyOf"][0] for name, schema in body["properties"].items() if "anyOf" in schema}
    assert props["logprobs"]["maximum"] == props["prompt_logprobs"]["maximum"] == 5
    assert (props["frequency_penalty"]["minimum"], props["frequency_penalty"]["maximum"]) == (-2, 2)
    assert props["repetition_penalty"]["exclusiveMinimum"] == 0 and props["min_tokens"]["minimum"] == 0
    bias = props["logit_bias"]
    assert bias["maxProperties"] == 300 and bias["additionalProperties"]["maximum"] == 100
    keys = re.compile(bias["propertyNames"]["pattern"])
    assert [str(i) for i in range(1000) if keys.search(str(i))] == [str(i) for i in range(300)]
    assert not any(keys.search(k) for k in ("-1", "05", "00", " 1", "1.0", "300", ""))
    chat = request_schema("chat", "tiny", 64, 300, 7)["properties"]["top_logprobs"]["anyOf"][0]
    assert chat["maximum"] == 7


def test_a_request_the_http_parser_refuses_is_one_short_warning_not_a_traceback(caplog):
    """Found by a fault-finding helper: every malformed request (a megabyte of method, a header over 8 KB) logged
    a traceback at ERROR, with the bytes it got: a scanner could fill the log and page on-call. Now one WARNING
    line each, cut short; the client still gets a 400."""
    import logging

    from aiohttp.test_utils import TestServer

    from lockstep.coordinator.openai_api import OpenAIServer

    async def go() -> list[bytes]:
        async with TestServer(OpenAIServer(FakeFrontend([])).app()) as server:
            answers = []
            for sent in (b"a" * 100_000 + b" / HTTP/1.1\r\nHost: x\r\n\r\n",
                         b"GET /health HTTP/1.1\r\nX-Big: " + b"b" * 100_000 + b"\r\n\r\n"):
                reader, writer = await asyncio.open_connection(server.host, server.port)
                writer.write(sent)
                await writer.drain()
                answers.append(await reader.read(12))
                writer.close()
            await asyncio.sleep(0.1)
            return answers

    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        assert asyncio.run(go()) == [b"HTTP/1.0 400"] * 2
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records  # (aiohttp logs the first; a header too long it refuses quietly)
    for r in records:
        assert r.levelno == logging.WARNING and r.exc_info is None and r.exc_text is None
        assert len(r.getMessage()) < 320 and "\n" not in r.getMessage()
        assert r.getMessage().startswith("refused a malformed HTTP request from 127.0.0.1: ")
