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
BUDGET = 24
CHAT = "/v1/chat/completions"
MAX_LOGPROBS = 25  # above vLLM's default 20: the coordinator's --max-logprobs is what counts


@pytest.fixture(scope="module")
def group(tiny_llama, tmp_path_factory):
    # a small token budget: a prompt over BUDGET tokens is prefilled in chunks, which prompt logprobs must span
    c = Cluster(tiny_llama, tp=2, kv_pages=128, log_dir=tmp_path_factory.mktemp("logs"),
                coordinator_args=["--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", str(BUDGET),
                                  "--max-logprobs", str(MAX_LOGPROBS)])
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
        whole = [e for e in (entry, *entry["top_logprobs"]) if "\ufffd" not in e["token"]]  # else part of one
        assert all(e["bytes"] == list(e["token"].encode()) for e in whole)
        top = entry["top_logprobs"]
        assert [e["logprob"] for e in top] == pytest.approx(ref[i].topk(4).values.tolist(), abs=TOL)
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


# ----- echo with logprobs: the prompt's tokens are scored too (lm-eval's loglikelihood)


def _check_echoed(lps: dict, ref: torch.Tensor, ids: list[int], k: int, text) -> None:
    """The prompt's part of an echoed choice's logprobs: position i's is log_softmax(logits[i - 1])[ids[i]],
    the first null; top_logprobs the k largest and the prompt token (up to k + 1), the first null."""
    n = len(ids)
    assert lps["tokens"][:n] == [text(t) for t in ids]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for i in range(1, n):
        assert lps["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOL), i
        want: dict[str, float] = {}
        for j in [*ref[i - 1].topk(k).indices.tolist(), ids[i]]:
            want.setdefault(text(j), ref[i - 1, j].item())
        top = lps["top_logprobs"][i]
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=TOL), i
    assert lps["text_offset"][0] == 0


@pytest.fixture(scope="module")
def text(tiny_llama):
    from lockstep.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_llama)
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("length", [9, BUDGET * 3 + 5])  # one chunk; four chunks of prefill
def test_echo_scores_every_prompt_token_as_transformers_does(group, log_softmax, text, no_leak, length):
    ids, k = prompt(80 + length, length), 3
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "echo": True, "logprobs": k}
    status, out = group.complete(body)
    assert status == 200, out
    choice = out["choices"][0]
    gen, lps = choice["token_ids"], choice["logprobs"]
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == length + 3
    ref = log_softmax(ids + gen)
    _check_echoed(lps, ref, ids, k, text)
    for i, t in enumerate(gen):  # then the generated tokens', as without echo
        assert lps["token_logprobs"][length + i] == pytest.approx(ref[length - 1 + i, t].item(), abs=TOL)
    assert gen == [int(ref[length - 1 + i].argmax()) for i in range(3)]
    # the same prompt again, its pages now in every rank's prefix cache: computed again, the same numbers
    status, warm = group.complete({"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert status == 200 and warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 or length < 16, warm
    status, again = group.complete(body)
    assert status == 200, again
    assert again["choices"][0]["logprobs"] == lps
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no cached position skipped
    streamed = _stream(group, "/v1/completions", body)  # a stream's first chunk carries the prompt's
    joined: dict[str, list] = {name: [] for name in lps}
    for chunk in streamed:
        for name, values in chunk["choices"][0]["logprobs"].items():
            joined[name].extend(values)
    assert joined == lps


def test_lm_eval_loglikelihood_request(group, log_softmax, text, no_leak):
    """What lm-eval's local-completions sends for loglikelihood (echo, logprobs 1, max_tokens 1, temperature 0,
    token ids) and how it reads the answer: the continuation's logprobs are token_logprobs[ctxlen:-1]."""
    context, continuation = prompt(90, 12), prompt(91, 5)
    ids = context + continuation
    status, out = group.complete({"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
                                  "seed": 1234})
    assert status == 200, out
    lps = out["choices"][0]["logprobs"]
    ref = log_softmax(ids)
    got = sum(lps["token_logprobs"][len(context):-1])
    want = sum(ref[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
    assert got == pytest.approx(want, abs=5 * TOL)
    greedy = all(ref[i - 1].argmax().item() == ids[i] for i in range(len(context), len(ids)))
    assert greedy == all(t == max(top.values()) for t, top in zip(lps["token_logprobs"][len(context):-1],
                                                                   lps["top_logprobs"][len(context):-1], strict=True))


def test_echo_logprobs_with_the_openai_client(group, log_softmax, text, no_leak):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=group.url + "/v1", api_key="none")
    ids = prompt(92, 30)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=ids, max_tokens=2, echo=True,
                                    logprobs=2, temperature=0)
    lps = out.choices[0].logprobs
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None and len(lps.tokens) == 32
    ref = log_softmax(ids)
    assert lps.token_logprobs[1:30] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, 30)], abs=TOL)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=out.model, prompt=ids, max_tokens=2, echo=True, logprobs=MAX_LOGPROBS + 1)


def test_echo_of_a_one_token_prompt_and_of_n_choices(group, no_leak):
    status, out = group.complete({"prompt": [7], "max_tokens": 2, "echo": True, "logprobs": 0, "temperature": 0,
                                  "ignore_eos": True})
    assert status == 200, out
    lps = out["choices"][0]["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None and len(lps["tokens"]) == 3
    ids = prompt(93, 20)
    status, out = group.complete({"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1, "n": 2, "seed": 4,
                                  "temperature": 1.0, "ignore_eos": True})
    assert status == 200, out
    a, b = (c["logprobs"] for c in out["choices"])
    # both choices score the prompt (batched together, so equal up to the batch layout's rounding)
    assert a["token_logprobs"][1:20] == pytest.approx(b["token_logprobs"][1:20], abs=TOL)
    assert [top.keys() for top in a["top_logprobs"][1:20]] == [top.keys() for top in b["top_logprobs"][1:20]]


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


def _scored_by_position(plan_box: list) -> object:
    """A tamper that has each rank score the chunks that ask: the entry of position p says -(p + 1) on the
    first rank (and nonsense on the others, which must not come through)."""
    from dataclasses import replace

    from lockstep.steps import PromptLogprobs, TokenLogprobs

    def tamper(reports: list) -> None:
        plan = plan_box[-1]
        for i, report in enumerate(reports):
            scored = []
            for c in plan.batch:
                if c.prompt_logprobs >= 0:
                    n = len(c.token_ids) - 1 + (c.next_token_id >= 0)
                    scored.append(PromptLogprobs(c.request_id, c.start, tuple(
                        TokenLogprobs(-(c.start + j + 1) - 100 * report.rank) for j in range(n))))
            reports[i] = replace(report, prompt_logprobs=tuple(scored))

    return tamper


def test_the_scheduler_scores_every_prompt_position_once_across_chunks_and_skips_no_cached_page():
    from lockstep.coordinator.request import Request
    from lockstep.coordinator.scheduler import TOKEN
    from lockstep.steps import SamplingParams
    from sim_ranks import Group, make_sched

    sched = make_sched(ranks=2, budget=5)  # pages of 4 tokens, 5 tokens a step: 19 prompt tokens take 4 chunks
    g = Group(sched, [32, 32])
    ids = list(range(10, 29))
    sched.add(Request("warm", ids, max_tokens=2))  # fills both ranks' prefix caches with the prompt's pages
    while sched.has_work():
        g.run_step()
    plans: list = []
    sched.add(Request("lp", ids, SamplingParams(logprobs=1, prompt_logprobs=2), max_tokens=2))
    while sched.has_work():
        g.run_step(between=plans.append, tamper=_scored_by_position(plans))
    chunks = [c for p in plans for c in p.batch]
    assert not any(p.probes for p in plans) and all(a.prefix_keys == () for p in plans for a in p.admits)
    assert chunks[0].start == 0 and [c.prompt_logprobs for c in chunks] == [2, 2, 2, 2, -1]  # the decode: none
    for c in chunks[:3]:  # each chunk's last position predicts the prompt token after it
        assert c.next_token_id == ids[c.start + len(c.token_ids)]
    assert chunks[3].next_token_id == -1  # the prompt's last token predicts a generated one: not the prompt's
    tokens = [e for e in g.events if e.request_id == "lp" and e.kind == TOKEN]
    assert [lp.logprob for lp in tokens[0].prompt_logprobs] == [-p for p in range(1, 19)]
    assert tokens[1].prompt_logprobs is None


def test_a_recompute_scores_no_position_twice():
    from lockstep.coordinator.request import Request
    from lockstep.steps import PromptLogprobs, SamplingParams, TokenLogprobs

    req = Request("r", list(range(3, 13)), SamplingParams(prompt_logprobs=0))
    asked = 0  # the chunk's prompt_logprobs: scores asked for
    assert req.scoring_prompt and req.prompt_scoring(0, 4) == (0, 7)
    assert req.take_prompt_scores(asked, PromptLogprobs("r", 0, tuple(TokenLogprobs(-p - 1.0) for p in range(4))))
    assert req.prompt_scoring(0, 4) == (-1, -1) and req.prompt_scoring(0, 6) == (0, 9)  # a recompute of [0, 6)
    req.take_prompt_scores(asked, PromptLogprobs("r", 0, tuple(TokenLogprobs(-p - 1.0) for p in range(6))))
    req.take_prompt_scores(asked, PromptLogprobs("r", 6, tuple(TokenLogprobs(-p - 7.0) for p in range(4))))
    assert [e.logprob for e in req.prompt_logprobs] == [-p for p in range(1, 10)]  # none twice, none past the end
    assert not req.scoring_prompt and req.prompt_scoring(0, 10) == (-1, -1)
    assert not req.take_prompt_scores(asked, None)  # asked and not sent: the request fails
    assert req.take_prompt_scores(-1, None)  # not asked


@pytest.mark.slow
def test_lm_eval_local_completions_scores_a_multiple_choice_item(group, log_softmax, tiny_llama, no_leak):
    """lm-evaluation-harness's own client (local-completions, tokenized requests) on a two-choice item: its
    loglikelihoods are transformers' sums over each continuation's tokens."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    status, models = http("GET", group.url + "/v1/models")
    assert status == 200, models
    lm = LocalCompletionsAPI(model=models["data"][0]["id"], base_url=group.url + "/v1/completions",
                             tokenizer=str(tiny_llama), tokenizer_backend="huggingface", max_retries=1)
    context, choices = "The sky is", [" blue", " made of green cheese"]
    got = lm.loglikelihood([Instance("loglikelihood", {}, (context, c), i) for i, c in enumerate(choices)])
    for (logprob, greedy), choice in zip(got, choices, strict=True):  # its token ids, as it splits the pair
        ctx, whole = lm.tok_encode(context), lm.tok_encode(context + choice)
        ref = log_softmax(whole)
        cont = range(len(ctx), len(whole))
        assert logprob == pytest.approx(sum(ref[i - 1, whole[i]].item() for i in cont), abs=10 * TOL)
        assert greedy == all(int(ref[i - 1].argmax()) == whole[i] for i in cont)


def test_vllm_prompt_logprobs_carry_each_prompt_tokens_logprob_and_rank(group, log_softmax, text, no_leak):
    ids, k = prompt(94, BUDGET + 7), 2  # two chunks of prefill
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "prompt_logprobs": k}
    status, out = group.complete(body)
    assert status == 200, out
    choice = out["choices"][0]
    got, ref = choice["prompt_logprobs"], log_softmax(ids)
    assert choice["logprobs"] is None and got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        row, t = ref[i - 1], ids[i]
        top = row.topk(k).indices.tolist()
        assert list(got[i]) == list(dict.fromkeys(str(j) for j in [t, *top])), i  # the prompt token first
        assert got[i][str(t)]["logprob"] == pytest.approx(row[t].item(), abs=TOL)
        assert got[i][str(t)]["rank"] == int((row > row[t]).sum()) + 1 and got[i][str(t)]["decoded_token"] == text(t)
        for rank, j in enumerate(top, start=1):
            assert got[i][str(j)]["logprob"] == pytest.approx(row[j].item(), abs=TOL)
            assert got[i][str(j)]["rank"] == rank or j == t
    first = _stream(group, "/v1/completions", body)[0]["choices"][0]
    assert first["prompt_logprobs"] == got


def test_max_logprobs_is_the_coordinators_setting(group, no_leak):
    """--max-logprobs 25: 25 is served (the k most likely and the sampled one), 26 is a 400 naming the limit,
    on completions, chat and /openapi.json alike."""
    body = {"prompt": prompt(7, 12), "max_tokens": 2, "temperature": 0, "logprobs": MAX_LOGPROBS}
    status, out = group.complete(body)
    assert status == 200, out
    assert len(out["choices"][0]["logprobs"]["top_logprobs"]) == 2
    status, err = group.complete({**body, "logprobs": MAX_LOGPROBS + 1})
    assert status == 400 and err["error"]["param"] == "logprobs" and str(MAX_LOGPROBS) in err["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True, "logprobs": True,
            "top_logprobs": MAX_LOGPROBS}
    status, out = http("POST", group.url + CHAT, chat)
    assert status == 200, out
    assert [len(e["top_logprobs"]) for e in out["choices"][0]["logprobs"]["content"]] == [MAX_LOGPROBS] * 2
    status, err = http("POST", group.url + CHAT, {**chat, "top_logprobs": MAX_LOGPROBS + 1})
    assert status == 400 and err["error"]["param"] == "top_logprobs"
    status, doc = http("GET", group.url + "/openapi.json")
    schema = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert f'"maximum": {MAX_LOGPROBS}' in json.dumps(_find(schema, "logprobs"))


def _find(schema, name: str):
    """The first property schema called `name` anywhere inside an OpenAPI schema."""
    if isinstance(schema, dict):
        if name in schema.get("properties", {}):
            return schema["properties"][name]
        for v in schema.values():
            found = _find(v, name)
            if found is not None:
                return found
    elif isinstance(schema, list):
        for v in schema:
            found = _find(v, name)
            if found is not None:
                return found
    return None


# ----- issue 13's leftovers on the real group: echo without generation, stop_reason, gRPC prompt_logprobs


def test_max_tokens_0_with_echo_scores_the_prompt_as_max_tokens_1_does(group, log_softmax, no_leak):
    """vLLM's echo without generation: the prompt and its logprobs, nothing generated, finish_reason "length";
    the ranks ran it with one token, which is dropped."""
    ids, k = prompt(95, BUDGET + 5), 2  # two chunks of prefill
    body = {"prompt": ids, "echo": True, "logprobs": k, "temperature": 0, "return_token_ids": True}
    status, zero = group.complete({**body, "max_tokens": 0})
    assert status == 200, zero
    status, one = group.complete({**body, "max_tokens": 1})
    assert status == 200, one
    z, o = zero["choices"][0], one["choices"][0]
    assert z["token_ids"] == [] and z["finish_reason"] == "length" and z["stop_reason"] is None
    assert z["text"] == o["text"][:len(z["text"])] and len(o["token_ids"]) == 1
    assert zero["usage"]["completion_tokens"] == 0 and zero["usage"]["prompt_tokens"] == len(ids)
    assert {name: values[:len(ids)] for name, values in o["logprobs"].items()} == z["logprobs"]
    ref = log_softmax(ids)
    assert z["logprobs"]["token_logprobs"][1:] == pytest.approx([ref[i - 1, ids[i]].item()
                                                                 for i in range(1, len(ids))], abs=TOL)
    streamed = _stream(group, "/v1/completions", {**body, "max_tokens": 0})
    assert "".join(c["choices"][0]["text"] for c in streamed) == z["text"]
    assert [t for c in streamed for t in c["choices"][0]["logprobs"]["token_logprobs"]] == \
        z["logprobs"]["token_logprobs"]
    status, bad = group.complete({"prompt": ids, "max_tokens": 0})
    assert status == 400 and bad["error"]["param"] == "max_tokens", bad


def test_stop_reason_names_the_stop_token_or_string_that_ended_the_choice(group, text, no_leak):
    ids = prompt(96, 10)
    status, free = group.complete({"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                   "return_token_ids": True})
    assert status == 200, free
    gen = free["choices"][0]["token_ids"]
    assert free["choices"][0]["stop_reason"] is None  # the length ended it
    at = gen[2]
    status, out = group.complete({"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                  "stop_token_ids": [at], "return_token_ids": True})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == at
    assert choice["token_ids"] == gen[:gen.index(at) + 1]
    words = free["choices"][0]["text"]
    assert words, free  # the tiny model's greedy text: its last character is a stop string that fires
    chunks = _stream(group, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                "stop": [words[-1]]})
    ends = [c["choices"][0] for c in chunks]
    assert (ends[-1]["finish_reason"], ends[-1]["stop_reason"]) == ("stop", words[-1])
    assert [e["stop_reason"] for e in ends[:-1]] == [None] * (len(ends) - 1)
    assert "".join(e["text"] for e in ends) == words[:words.index(words[-1])]


def test_grpc_prompt_logprobs_over_a_real_channel(group, log_softmax, no_leak):
    import asyncio

    import grpc

    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
    from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc

    ids, k = prompt(97, BUDGET + 3), 3
    req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids), max_tokens=2, temperature=0, prompt_logprobs=k,
                              ignore_eos=True)

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{group.grpc_port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            return await stub.Complete(req), [m async for m in stub.Generate(req)]

    done, streamed = asyncio.run(go())
    ref = log_softmax(ids)
    assert [m.token_id for m in done.prompt_logprobs] == ids[1:]
    for i, m in enumerate(done.prompt_logprobs, start=1):
        row = ref[i - 1]
        assert m.logprob == pytest.approx(row[ids[i]].item(), abs=TOL)
        assert m.rank == int((row > row[ids[i]]).sum()) + 1
        assert list(m.top_ids) == row.topk(k).indices.tolist()
        assert list(m.top_logprobs) == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
    assert list(streamed[0].prompt_logprobs) == list(done.prompt_logprobs)
    assert not any(m.prompt_logprobs for m in streamed[1:]) and streamed[-1].finish_reason == "length"
