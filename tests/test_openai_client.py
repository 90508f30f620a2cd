"""Conformance with the official `openai` Python client against a real served group (one rank, the tiny
Llama): completions and chat, sync and async, streaming with `include_usage`, and every error raised as
the client's own exception type. What a client library parses is checked by the client itself."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

KEY = "client-key"
MODEL = "tiny"
TOKENS = 6


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """One rank behind an API key, as a client would meet a deployment."""
    from cluster import Cluster

    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path_factory.mktemp("logs"),
                coordinator_args=["--api-key", KEY, "--served-model-name", MODEL])
    yield c
    c.close()


def _client(served, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_sync_completion_and_chat(served):
    client = _client(served)
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, temperature=0, seed=1)
    assert done.object == "text_completion" and done.model == MODEL and len(done.choices) == 1
    assert done.choices[0].finish_reason in ("stop", "length") and isinstance(done.choices[0].text, str)
    assert done.usage.prompt_tokens > 0 and 0 < done.usage.completion_tokens <= TOKENS
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=TOKENS, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str) and chat.usage.completion_tokens <= TOKENS
    assert [m.id for m in client.models.list()] == [MODEL]


def test_sync_streams_end_with_a_usage_chunk(served):
    client = _client(served)
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text  # greedy: the same
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=TOKENS, temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chat if c.choices]
    assert deltas[0].role == "assistant" and all(isinstance(d.content, str) for d in deltas)
    assert chat[-1].choices == [] and 0 < chat[-1].usage.completion_tokens <= TOKENS
    assert all(c.usage is None for c in chat[:-1]) and chat[-2].choices[0].finish_reason in ("stop", "length")


def test_async_completion_chat_and_stream(served):
    async def go() -> tuple:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            done, chat = await asyncio.gather(
                c.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, temperature=0),
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=TOKENS, temperature=0))
            stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=TOKENS, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
        return done, chat, chunks

    done, chat, chunks = asyncio.run(go())
    assert done.choices[0].text is not None and chat.choices[0].message.content is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy: streamed and whole agree
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]  # vLLM's return_token_ids: a field the client keeps as an extra


def test_n_choices_each_with_its_own_seed_stream(served):
    """n=3 with a seed: choice 0 is the n=1 answer of that seed, the others draw differently; usage counts the
    prompt once; a stream carries every choice by its index; greedy choices are all the same."""
    client = _client(served)
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": TOKENS, "temperature": 1.0, "seed": 5,
            "extra_body": {"ignore_eos": True}}
    one = client.completions.create(**args)
    many = client.completions.create(**args, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == one.choices[0].text  # choice i draws with seed + i
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.prompt_tokens == one.usage.prompt_tokens and many.usage.completion_tokens == 3 * TOKENS
    chunks = list(client.completions.create(**args, n=2, stream=True, stream_options={"include_usage": True}))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == \
            many.choices[i].text
    assert chunks[-1].usage.completion_tokens == 2 * TOKENS
    greedy = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=TOKENS, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=17)
    assert bad.value.param == "n"
    served.assert_no_leak()


def test_chat_content_parts(served):
    """Text parts (guidellm's and many SDKs' default) are joined by newlines; an image part is a 400 naming it."""
    client = _client(served)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi\nthere"}],
                                           max_tokens=TOKENS, temperature=0)
    parts = client.chat.completions.create(model=MODEL, max_tokens=TOKENS, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert bad.value.param == "messages" and "image_url" in bad.value.message


def test_stop_token_ids_and_echo(served):
    """A stop token ends the answer (finish_reason stop), its id in token_ids and not its text, unless
    include_stop_str_in_output; echo puts the prompt before the text."""
    client = _client(served)
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": TOKENS, "temperature": 0}
    full = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = _ids(full.choices[0])
    k = ids.index(ids[2])
    extra = {"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [ids[2]]}
    cut = client.completions.create(**args, extra_body=extra)
    kept = client.completions.create(**args, extra_body={**extra, "include_stop_str_in_output": True})
    for done in (cut, kept):
        assert done.choices[0].finish_reason == "stop" and _ids(done.choices[0]) == ids[:k + 1]
        assert done.usage.completion_tokens == k + 1
    stop_text = client.post(served.url + "/detokenize", body={"tokens": [ids[2]]}, cast_to=object)["prompt"]
    assert kept.choices[0].text == cut.choices[0].text + stop_text and full.choices[0].text.startswith(
        kept.choices[0].text)
    echoed = client.completions.create(**args, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Hello" + full.choices[0].text
    served.assert_no_leak()


def test_errors_are_the_clients_exception_types(served):
    client = _client(served)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, top_p=0)
    assert bad.value.status_code == 400 and bad.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, extra_body={"nonsense": 1})
    assert unsupported.value.code == "unsupported_field" and unsupported.value.param == "nonsense"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert missing.value.status_code == 404
    with pytest.raises(openai.AuthenticationError) as denied:
        _client(served, "wrong-key").completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"

    async def go_async() -> None:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0) as c:
            await c.completions.create(model=MODEL, prompt="Hello", max_tokens=TOKENS, temperature=-1)

    with pytest.raises(openai.BadRequestError):
        asyncio.run(go_async())
    served.assert_no_leak()


def test_logprobs_parse_as_the_clients_types(served):
    """Completions' legacy `logprobs` and chat's `logprobs.content` (with `bytes` and `top_logprobs`), whole and
    streamed, are the client's own typed objects; a bad count is its BadRequestError naming the field."""
    client = _client(served)
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": TOKENS, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    done = client.completions.create(**args, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == TOKENS
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs)
    assert all(isinstance(top, dict) and 1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.token_logprobs[0] == max(lp.top_logprobs[0].values())  # greedy: the most likely token
    streamed = [c.choices[0].logprobs for c in client.completions.create(**args, logprobs=3, stream=True)]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == TOKENS
    for entry in content:
        assert isinstance(entry.token, str) and all(0 <= b < 256 for b in entry.bytes)
        if "\ufffd" not in entry.token:  # whole characters: their UTF-8 (a part of one: its own bytes)
            assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == entry.logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert [e for c in chunks if c.choices for e in c.choices[0].logprobs.content] == content
    for bad, param in (({"logprobs": 21}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as refused:
            if param == "logprobs":
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **bad)
            else:
                client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **bad)
        assert refused.value.param == param
    served.assert_no_leak()


def test_stop_reason_and_echo_without_generation(served):
    """vLLM's per-choice stop_reason as the client reads it (an extra field of its Choice), in a whole answer and
    in the streamed chunk that ends the choice; and max_tokens 0 with echo: the prompt, nothing generated."""
    client = _client(served)
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": TOKENS, "temperature": 0}
    full = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = _ids(full.choices[0])
    extra = {"ignore_eos": True, "stop_token_ids": [ids[2]]}
    cut = client.completions.create(**args, extra_body=extra)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == ids[2]
    assert full.choices[0].model_extra["stop_reason"] is None
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, stream=True, extra_body=extra)
    ends = [c.choices[0] for c in chat if c.choices and c.choices[0].finish_reason is not None]
    assert len(ends) == 1 and ends[0].model_extra["stop_reason"] in (None, ids[2])
    assert (ends[0].model_extra["stop_reason"] == ids[2]) == (ends[0].finish_reason == "stop")
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=0, echo=True, logprobs=1)
    assert echoed.choices[0].text == "Hello" and echoed.choices[0].finish_reason == "length"
    assert echoed.usage.completion_tokens == 0 and echoed.choices[0].logprobs.token_logprobs[0] is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)
    served.assert_no_leak()


def test_echo_of_token_ids_keeps_their_special_tokens_as_the_logprobs_offsets_count_them(served):
    """vLLM echoes token ids as `decode(ids)` with the special tokens: without them (found by a helper) the
    echoed text lost `<s>`, and every `text_offset` pointed past where its token is in the text."""
    client = _client(served)
    ids = client.post(served.url + "/tokenize", body={"prompt": "Hello there"}, cast_to=object)["tokens"]
    done = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=0,
                                     extra_body={"ignore_eos": True})
    choice = done.choices[0]
    assert choice.text.startswith("<s>Hello there")
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert tokens[0] == "<s>"  # the tiny tokenizer adds its bos
    for token, at in zip(tokens, offsets, strict=True):
        assert choice.text[at:at + len(token)] == token


def test_models_retrieve_names_the_served_model_and_refuses_another(served):
    client = _client(served)
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and MODEL in err.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        _client(served, "wrong").models.retrieve(MODEL)
