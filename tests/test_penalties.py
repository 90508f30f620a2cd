"""Penalties and biases (model/penalties.py): vLLM's arithmetic, bit for bit, against a dense reference written
as vLLM writes it; the rank's token counts from the plans' chunks; and no input at all makes them raise or
create a NaN (a failure there would break a whole TP group)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.model.penalties import PenaltyBook, RowPenalty, TokenCounts, penalize
from lockstep.model.sampling import sample
from lockstep.steps import Chunk, SamplingParams

V = 24
INF, NAN = math.inf, math.nan


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row as vLLM's v1 sampler computes it: float32; logit_bias added and min_tokens' stop ids at -inf
    (its logits processors); then apply_penalties with dense masks and bin counts: / r where > 0 else * r
    (its CUDA kernel) over prompt | output, `-= f * counts`, `-= p * mask`."""
    x = logits.to(torch.float32).clone()
    vocab = x.shape[-1]
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        x[list(p.stop_token_ids)] = -INF
    prompt_mask = torch.zeros(vocab, dtype=torch.bool)
    prompt_mask[prompt] = True
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
    output_mask = counts > 0
    penalties = torch.where(prompt_mask | output_mask, torch.tensor(p.repetition_penalty, dtype=torch.float32), 1.0)
    x = torch.where(x > 0, x / penalties, x * penalties)
    x -= torch.tensor(p.frequency_penalty, dtype=torch.float32) * counts
    x -= torch.tensor(p.presence_penalty, dtype=torch.float32) * output_mask
    return x


def _row(p: SamplingParams, prompt: list[int], output: list[int], vocab: int = V) -> RowPenalty | None:
    return RowPenalty.of(p, len(output), TokenCounts.of(prompt + output, len(prompt)), vocab)


ids = st.lists(st.integers(0, V - 1), max_size=12)
params = st.builds(
    SamplingParams,
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.2, 2.0, 1e-3, 7.25]),
    frequency_penalty=st.floats(-2, 2, width=32),
    presence_penalty=st.floats(-2, 2, width=32),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100, width=32), max_size=5),
    min_tokens=st.integers(0, 4),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=3).map(tuple),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(params, st.lists(st.tuples(ids.filter(bool), ids), min_size=1, max_size=4), st.integers(0, 2**31))
def test_penalize_is_vllms_arithmetic_bit_for_bit(p, rows, seed):
    logits = 4 * torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed))
    logits[0, 0] = 0.0  # a zero logit is neither divided nor multiplied
    got = penalize(logits, [_row(p, prompt, output) for prompt, output in rows])
    want = torch.stack([reference(logits[i], p, prompt, output) for i, (prompt, output) in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_each_adjustment_moves_the_right_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0, 3.0, -1.0]])
    prompt, output = [0, 1], [2, 2, 4]

    def run(**kw) -> list[float]:
        return penalize(logits, [_row(SamplingParams(**kw), prompt, output, 6)])[0].tolist()

    assert run(repetition_penalty=2.0) == [1.0, -4.0, 0.5, 0.0, 1.5, -1.0]  # prompt and output, not token 5
    assert run(frequency_penalty=0.5) == [2.0, -2.0, 0.0, 0.0, 2.5, -1.0]  # output only, times the count
    assert run(presence_penalty=0.5) == [2.0, -2.0, 0.5, 0.0, 2.5, -1.0]  # output only, once
    assert run(logit_bias={5: 10.0, 3: -1.5}) == [2.0, -2.0, 1.0, -1.5, 3.0, 9.0]
    # min_tokens holds the stop ids off while fewer than min_tokens are out (3 are)
    assert run(min_tokens=4, stop_token_ids=(4, 0)) == [-INF, -2.0, 1.0, 0.0, -INF, -1.0]
    assert run(min_tokens=3, stop_token_ids=(4, 0)) == logits[0].tolist()
    # vLLM's order: the bias first, then the repetition penalty sees the biased logit
    assert run(logit_bias={1: 4.0}, repetition_penalty=2.0) == [1.0, 1.0, 0.5, 0.0, 1.5, -1.0]


def test_plain_rows_are_only_widened_and_greedy_follows_the_penalties():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]], dtype=torch.bfloat16)
    rows = [None, _row(SamplingParams(repetition_penalty=4.0), [1], [], 3)]
    out = penalize(logits, rows)
    assert out.dtype == torch.float32 and out[0].tolist() == [1.0, 3.0, 2.0]
    assert sample(out, [SamplingParams()] * 2, [0, 0]) == [1, 2]  # greedy: the penalized argmax moves
    assert RowPenalty.of(SamplingParams(temperature=0.5), 0, None, 3) is None


@pytest.mark.parametrize("p", [
    SamplingParams(repetition_penalty=INF), SamplingParams(repetition_penalty=1e300),
    SamplingParams(repetition_penalty=0.0), SamplingParams(repetition_penalty=-3.0),
    SamplingParams(repetition_penalty=NAN), SamplingParams(repetition_penalty=1e-300),
    SamplingParams(frequency_penalty=INF), SamplingParams(frequency_penalty=-INF, presence_penalty=INF),
    SamplingParams(frequency_penalty=NAN, presence_penalty=NAN), SamplingParams(frequency_penalty=1e38),
    SamplingParams(logit_bias={0: INF, 1: -INF, 2: NAN, -5: 1.0, 10**9: 1.0}),
    SamplingParams(min_tokens=5, stop_token_ids=(-1, 10**12, 3)), SamplingParams(min_tokens=-7, stop_token_ids=(3,)),
])
def test_no_parameter_and_no_logit_creates_a_nan_or_raises(p):
    logits = torch.tensor([[0.0, -0.0, INF, -INF, NAN, 1e38, -1e38, 1e-45, 5.0, -5.0]])
    output = [0, 1, 2, 3, 4, 5, 6, 7] * 1000  # large counts
    row = _row(p, [8, 9, 0], output, 10)
    out = penalize(logits, [row])
    assert out.shape == logits.shape and out.dtype == torch.float32
    assert torch.isnan(out).tolist() == torch.isnan(logits).tolist()  # NaN only where it came in
    assert 0 <= sample(out, [SamplingParams()], [0])[0] < 10
    assert 0 <= sample(out, [SamplingParams(temperature=1.0, top_p=0.5)], [1])[0] < 10


def test_degenerate_shapes():
    assert penalize(torch.zeros(0, V), []).shape == (0, V)
    with pytest.raises(ValueError):
        penalize(torch.zeros(2, V), [None])  # a caller's mismatch, never request content
    row = _row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), [], [], V)
    assert penalize(torch.ones(1, V), [row]).tolist() == torch.ones(1, V).tolist()  # no history yet


# ----- the rank's token counts


FREQ = SamplingParams(frequency_penalty=1.0)


def _chunk(tokens: list[int], start: int, sample_index: int, history: list[int] | None = None, sample: bool = True,
           p: SamplingParams = FREQ) -> Chunk:
    return Chunk("r", tuple(tokens), start, sample, p, sample_index, history=None if history is None else
                 tuple(history))


def test_the_book_counts_from_the_history_then_from_each_decode():
    book = PenaltyBook()
    assert book.counts(_chunk([1, 2, 3], 0, 0, sample=False)) is None  # a prefill before the history: nothing
    assert "r" not in book
    # a recompute after preemption: prompt [1, 2, 3, 4], output [5, 5] already generated
    counts = book.counts(_chunk([4, 5, 5], 3, 2, history=[1, 2, 3]))
    assert (counts.prompt_len, counts.length, counts.prompt, counts.output) == (4, 6, {1, 2, 3, 4}, Counter({5: 2}))
    counts = book.counts(_chunk([7], 6, 3))
    assert counts.output == Counter({5: 2, 7: 1}) and counts.length == 7
    assert book.counts(_chunk([7], 6, 3)).output[7] == 1  # a position seen already is not counted again
    book.release(["other"])
    assert "r" in book
    book.release(["r"])
    assert len(book) == 0
    assert book.counts(_chunk([1], 0, 0, p=SamplingParams(logit_bias={1: 1.0}))) is None  # needs no history
    book.counts(_chunk([9], 0, 0, history=[]))
    book.clear()
    assert len(book) == 0


def test_a_chunk_without_its_history_is_counted_alike_on_every_rank():
    """A coordinator's bug (no history): the rank still answers, from what the chunk holds."""
    counts = PenaltyBook().counts(_chunk([8, 9], 10, 1))
    assert counts.prompt == {8} and counts.output == Counter({9: 1})


def test_token_counts_of_a_sequence():
    c = TokenCounts.of([1, 1, 2, 3, 3, 3], 2)
    assert c.prompt == {1} and c.output == Counter({2: 1, 3: 3}) and c.length == 6
    assert TokenCounts.of([1, 2], 5).prompt_len == 2 and TokenCounts.of([1, 2], -1).output == Counter({1: 1, 2: 1})


# ----- the coordinator's side: which chunk carries the history, and min_tokens against stop tokens


def test_the_first_sampling_chunk_of_each_admission_carries_the_history():
    from lockstep.coordinator.request import Request

    req = Request("a", [1, 2, 3, 4, 5], FREQ, max_tokens=8, stop_token_ids=[9])
    req.num_computed = 3  # a cached prefix, or an earlier prefill chunk
    first = req.chunk(2)
    assert first.sample and first.history == (1, 2, 3) and first.token_ids == (4, 5)
    assert req.chunk(2) == first  # a step that no rank ran is planned again as it was: history included
    req.num_computed = 5
    req.append(6)
    decode = req.chunk(1)
    assert decode.token_ids == (6,) and decode.history is None and decode.sample_index == 1
    req.num_computed, req.num_preemptions = 0, 1  # preempted: the ranks dropped what they kept
    assert req.chunk(4).history is None and not req.chunk(4).sample  # a prefill chunk that samples nothing
    req.num_computed = 4
    assert req.chunk(2).history == (1, 2, 3, 4) and req.chunk(2).sample_index == 1
    plain = Request("b", [1, 2], SamplingParams(logit_bias={3: 1.0}), max_tokens=4)
    assert plain.chunk(2).history is None  # needs no counts: carries nothing


def test_min_tokens_holds_stop_tokens_and_is_sent_with_them():
    from lockstep.coordinator.request import FinishReason, Request

    req = Request("a", [1], SamplingParams(min_tokens=2), max_tokens=3, stop_token_ids=[9, 7])
    assert req.sampling.stop_token_ids == (7, 9)  # what the ranks hold off
    assert req.append(9) is None and req.append(7) == FinishReason.STOP
    assert Request("b", [1], SamplingParams(), stop_token_ids=[9]).sampling.stop_token_ids == ()
    with pytest.raises(ValueError, match="frequency_penalty"):
        Request("c", [1], SamplingParams(frequency_penalty=3.0))
    with pytest.raises(ValueError, match="repetition_penalty"):
        Request("c", [1], SamplingParams(repetition_penalty=0.0))


def test_stop_strings_wait_for_min_tokens():
    """vLLM looks for stop strings only once more than min_tokens tokens are out, and only for one that ends
    in the text after the min_tokens-th token's."""
    import asyncio

    from lockstep.coordinator.generation import GenerateSpec, TokenEvent, text_stream
    from lockstep.coordinator.request import FinishReason
    from test_generation import TOK, _events, tid

    async def text(min_tokens: int) -> str:
        spec = GenerateSpec([1], SamplingParams(min_tokens=min_tokens), 5, stop=["ab"])
        events = [TokenEvent(tid(c)) for c in "abab"] + [TokenEvent(tid("c"), FinishReason.LENGTH)]
        return "".join([p.text async for p in text_stream(TOK, spec, _events(*events))])

    assert [asyncio.run(text(m)) for m in (0, 1, 2, 3, 4, 5)] == ["", "", "ab", "ab", "ababc", "ababc"]


# ----- end to end: a real TP-2 group (two `lockstep rank` processes, gloo, the tiny Llama) against transformers

N = 12


@pytest.fixture(scope="module")
def group(tiny_llama, tmp_path_factory):
    from cluster import Cluster

    # rank 1's pool of 10 pages holds one request alone: concurrent ones are preempted and recomputed; a budget of
    # 16 tokens a step prefills every prompt in chunks, so the one that samples first needs the history before it
    c = Cluster(tiny_llama, tp=2, kv_pages=[128, 10], log_dir=tmp_path_factory.mktemp("logs"),
                coordinator_args=["--max-num-batched-tokens", "16", "--max-num-seqs", "16"])
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


def _reference_greedy(hf, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    """Greedy tokens from transformers' logits with vLLM's adjustments (the dense reference above)."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(torch.argmax(reference(logits, p, prompt, out))))
    return out


def _generate(group, prompt: list[int], n: int, **fields) -> tuple[list[int], str]:
    status, body = group.complete({"prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True,
                                   **fields})
    assert status == 200, body
    return body["choices"][0]["token_ids"], body["choices"][0]["finish_reason"]


def _prompt(seed: int, n: int) -> list[int]:
    from checkpoints import random_prompt

    ids = random_prompt(seed, n)
    return ids + ids[: n // 2]  # repeated tokens, which the penalties must see in the prompt


def test_repetition_penalty_greedy_is_transformers_generate(group, hf):
    for seed, r in ((1, 1.8), (2, 0.6)):
        prompt = _prompt(seed, 20)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                           repetition_penalty=r)[0, len(prompt):].tolist()
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False,
                            eos_token_id=None)[0, len(prompt):].tolist()
        assert want != plain  # the penalty changes this output: the test sees it applied
        assert _generate(group, prompt, N, ignore_eos=True, repetition_penalty=r) == (want, "length")
    group.assert_no_leak()


@pytest.mark.parametrize("fields", [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
                                    {"frequency_penalty": -0.7, "presence_penalty": 0.9, "repetition_penalty": 1.3}])
def test_frequency_and_presence_greedy_is_the_reference_loop(group, hf, fields):
    prompt = _prompt(3, 16)
    want = _reference_greedy(hf, prompt, N, SamplingParams(**fields))
    assert want != _reference_greedy(hf, prompt, N, SamplingParams())
    assert _generate(group, prompt, N, ignore_eos=True, **fields) == (want, "length")


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_off(group, tiny_llama):
    from lockstep.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_llama)
    eos = sorted(tokenizer.eos_token_ids)[0]
    forced = tokenizer.encode("Q", add_special_tokens=False)[0]  # one token of one character
    bias = {str(forced): 100}
    prompt = _prompt(4, 12)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}):
        assert _generate(group, prompt, 6, ignore_eos=True, logit_bias=bias, **sampling) == ([forced] * 6, "length")
    # EOS made all but certain: it ends the output at once, unless min_tokens holds it off that long
    assert _generate(group, prompt, 10, logit_bias={str(eos): 100}) == ([eos], "stop")
    got, reason = _generate(group, prompt, 10, logit_bias={str(eos): 100}, min_tokens=4)
    assert reason == "stop" and len(got) == 5 and got[-1] == eos and eos not in got[:-1]
    # nor does a stop string (vLLM's rule): only once more than min_tokens tokens are out, and only one that ends
    # in the text after the min_tokens-th token's
    for min_tokens, text in ((0, ""), (2, "Q"), (3, "QQ"), (5, "QQQQQ")):
        status, body = group.complete({"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                       "logit_bias": bias, "min_tokens": min_tokens, "stop": ["QQ", "x"]})
        assert status == 200, body
        assert body["choices"][0]["text"] == text, (min_tokens, body)
        assert body["choices"][0]["finish_reason"] == ("length" if min_tokens == 5 else "stop")
    group.assert_no_leak()


def test_preempted_penalized_requests_recompute_to_the_same_tokens(group, hf):
    from concurrent.futures import ThreadPoolExecutor

    fields = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.4}
    prompts = [_prompt(40 + i, 14) for i in range(5)]
    before = group.metric("lockstep_preemptions_total")
    greedy = {"ignore_eos": True, **fields}
    sampled = {"ignore_eos": True, "temperature": 1.0, "seed": 11, **fields}
    alone = [_generate(group, p, 24, **sampled) for p in prompts]
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        together = list(pool.map(lambda a: _generate(group, a[0], 24, **a[1]),
                                 [(p, f) for p in prompts for f in (greedy, sampled)]))
    assert sum(group.metric("lockstep_preemptions_total")) > sum(before)  # the pool forced recomputes
    for i, p in enumerate(prompts):
        assert together[2 * i] == (_reference_greedy(hf, p, 24, SamplingParams(**fields)), "length")
        assert together[2 * i + 1] == alone[i]  # a seeded draw recomputes to the same tokens
    group.assert_no_leak()


def test_one_engine_keeps_counts_only_for_penalized_requests_and_reports_raw_logprobs(tiny_llama, hf):
    """At TP 1, driven plan by plan: a chunked prefill whose sampling chunk carries the history, decodes that
    update the counts, the counts dropped on release; logprobs of the raw logits, whatever was forced."""
    from lockstep.engine import Engine
    from lockstep.engine_config import EngineConfig
    from lockstep.steps import Admit, Plan

    torch.set_num_threads(2)
    engine = Engine.create(EngineConfig(str(tiny_llama), page_size=16, kv_pages=32))
    p = SamplingParams(frequency_penalty=1.2, presence_penalty=0.3, repetition_penalty=1.5, logprobs=0)
    prompt = _prompt(9, 20)
    step = iter(range(1000))

    def run(**kw):
        report = engine.step(Plan(step=next(step), **kw))
        assert not report.error, report.error
        return report

    run(admits=(Admit("a", ()),), batch=(Chunk("a", tuple(prompt[:16]), 0, False, p),))
    assert "a" not in engine.penalties  # nothing kept before the chunk that samples
    got = run(batch=(Chunk("a", tuple(prompt[16:]), 16, True, p, 0, history=tuple(prompt[:16])),)).sampled
    out = [got[0].token_id]
    for i in range(1, 8):
        out.append(run(batch=(Chunk("a", (out[-1],), len(prompt) + i - 1, True, p, i),)).sampled[0].token_id)
    assert out == _reference_greedy(hf, prompt, 8, p)
    assert engine.penalties.counts(Chunk("a", (out[-1],), len(prompt) + 7, False, p)).output == Counter(out)
    run(releases=("a",))
    assert len(engine.penalties) == 0
    forced = SamplingParams(logit_bias={5: 100.0}, logprobs=0)
    s, = run(admits=(Admit("b", ()),), batch=(Chunk("b", tuple(prompt), 0, True, forced),)).sampled
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
    assert s.token_id == 5 and s.logprobs.logprob == pytest.approx(raw[5].item(), abs=1e-4) and raw[5] < -1
    assert len(engine.penalties) == 0  # a bias needs no counts
    run(release_all=True)
