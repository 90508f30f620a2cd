"""Logprobs end to end on a real TP-2 group (two `lockstep rank` processes, gloo, the tiny Llama): the numbers
a client gets are transformers' log_softmax of the model's logits at those positions (raw logprobs, vLLM's
default mode: before temperature, top-k and top-p), the top ones are the k largest, and a stream carries
exactly what the whole answer does."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from checkpoints import random_prompt as prompt
from cluster import Cluster, http

TOL = 1e-4
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def group(tiny_llama, tmp_path_factory):
    c = Cluster(tiny_llama, tp=2, kv_pages=128, log_dir=tmp_path_factory.mktemp("logs"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def log_softmax(tiny_llama):
    """ids -> [len(ids), vocab]: transformers' log_softmax of the logits at every position (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


@pytest.fixture
def no_leak(group):
    yield
    group.assert_no_leak()


def _stream(group: Cluster, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(group.url + path, method="POST", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [ln.decode().strip() for ln in resp if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _expected(log_softmax, ids: list[int], generated: list[int]) -> torch.Tensor:
    """Row i: the distribution generated[i] was drawn from."""
    return log_softmax(ids + generated[:-1])[len(ids) - 1:]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.3, "top_k": 7, "top_p": 0.8, "seed": 5}])
def test_completion_logprobs_are_transformers_log_softmax(group, log_softmax, tiny_llama, no_leak, sampling):
    from lockstep.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_llama)

    def text(token_id: int) -> str:  # as vLLM shows a token: decoded alone, special tokens kept
        return tokenizer.decode([token_id], skip_special_tokens=False)

    ids, k = prompt(70, 21), 5
    status, body = group.complete({"prompt": ids, "max_tokens": 7, "ignore_eos": True, "return_token_ids": True,
                                   "logprobs": k, **sampling})
    assert status == 200, body
    choice = body["choices"][0]
    gen, lps = choice["token_ids"], choice["logprobs"]
    ref = _expected(log_softmax, ids, gen)
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == len(gen) == 7
    for i, t in enumerate(gen):
        # raw logprobs: of the model's logits, whatever the temperature and filters the token was drawn with
        assert lps["token_logprobs"][i] == pytest.approx(ref[i, t].item(), abs=TOL)
        # the k most likely and the sampled token (OpenAI's and vLLM's rule: up to k + 1), keyed by their text,
        # where tokens of the same text (bytes of a character each read as U+FFFD) keep the most likely's
        want: dict[str, float] = {}
        for j in [*ref[i].topk(k).indices.tolist(), t]:
            want.setdefault(text(j), ref[i, j].item())
        top = lps["top_logprobs"][i]
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=TOL)
        assert lps["tokens"][i] == text(t)
    if sampling["temperature"] == 0:  # greedy: the chosen token is the most likely, so it heads the top k
        assert gen == [int(r.argmax()) for r in ref]
    assert lps["text_offset"][0] == 0
    offsets = lps["text_offset"]
    assert all(b - a == len(tok) for a, b, tok in zip(offsets[:-1], offsets[1:], lps["tokens"][:-1], strict=True))


def test_chat_top_logprobs_are_the_k_largest_with_bytes(group, log_softmax, no_leak):
    messages = [{"role": "user", "content": "hello there"}]
    status, tok = http("POST", group.url + "/tokenize", {"messages": messages})
    assert status == 200, tok
    status, body = http("POST", group.url + CHAT, {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True, "logprobs": True, "top_logprobs": 4,
                                                   "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    gen, content = choice["token_ids"], choice["logprobs"]["content"]
    ref = _expected(log_softmax, tok["tokens"], gen)
    assert len(content) == len(gen) == 6
    for i, (t, entry) in enumerate(zip(gen, content, strict=True)):
        assert entry["logprob"] == pytest.approx(ref[i, t].item(), abs=TOL)
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert [e["logprob"] for e in top] == pytest.approx(ref[i].topk(4).values.tolist(), abs=TOL)
        assert all(e["bytes"] == list(e["token"].encode()) for e in top)
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]  # greedy: the top one
    status, plain = http("POST", group.url + CHAT, {"messages": messages, "max_tokens": 2, "logprobs": True})
    assert status == 200 and all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    status, off = http("POST", group.url + CHAT, {"messages": messages, "max_tokens": 2})
    assert status == 200 and off["choices"][0]["logprobs"] is None


def test_streams_carry_the_same_logprobs_as_whole_answers(group, no_leak):
    body = {"prompt": prompt(71, 13), "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    status, whole = group.complete(body)
    assert status == 200, whole
    chunks = _stream(group, "/v1/completions", body)
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for name, values in chunk["choices"][0]["logprobs"].items():
            joined[name].extend(values)
    assert joined == whole["choices"][0]["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    status, whole = http("POST", group.url + CHAT, chat)
    assert status == 200, whole
    content = [e for c in _stream(group, CHAT, chat) for e in c["choices"][0]["logprobs"]["content"]]
    assert content == whole["choices"][0]["logprobs"]["content"] and len(content) == 5


def test_each_of_n_choices_carries_its_own_tokens_logprobs(group, log_softmax, no_leak):
    ids = prompt(72, 9)
    status, body = group.complete({"prompt": ids, "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2,
                                   "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
    assert status == 200, body
    for choice in body["choices"]:
        ref = _expected(log_softmax, ids, choice["token_ids"])
        got = choice["logprobs"]["token_logprobs"]
        assert got == pytest.approx([ref[i, t].item() for i, t in enumerate(choice["token_ids"])], abs=TOL)
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # k = 0: the sampled token only


# ----- the coordinator's side, without ranks: the first rank's entry reaches the TOKEN event


def test_the_scheduler_forwards_the_first_ranks_logprobs_into_token_events():
    from dataclasses import replace

    from lockstep.coordinator.request import Request
    from lockstep.coordinator.scheduler import TOKEN
    from lockstep.steps import SamplingParams, TokenLogprobs
    from sim_ranks import Group, make_sched

    sched = make_sched(ranks=2)
    g = Group(sched, [32, 32])
    sched.add(Request("lp", [3, 4, 5, 6, 7], SamplingParams(logprobs=2), max_tokens=3))
    asked = []

    def tamper(reports: list) -> None:
        for i, report in enumerate(reports):  # rank r says -r - 0.5: only rank 0's may come through
            reports[i] = replace(report, sampled=tuple(replace(s, logprobs=TokenLogprobs(
                -report.rank - 0.5, ((s.token_id, -report.rank - 0.5), (1, -9.0)))) for s in report.sampled))

    while sched.has_work():
        g.run_step(tamper=tamper)
        asked += [c.sampling.logprobs for p in g.plans[-1:] for c in p.batch if c.sample]
    tokens = [e for e in g.events if e.kind == TOKEN]
    assert len(tokens) == 3 and asked == [2, 2, 2]  # the chunks ask the ranks for them
    assert all(e.logprobs == TokenLogprobs(-0.5, ((e.token_id, -0.5), (1, -9.0))) for e in tokens)
