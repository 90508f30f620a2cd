"""lm-evaluation-harness (`local-completions`, the way evaluation users drive a vLLM-compatible server) against
a served group, on two tasks whose data ships in tests/fixtures/lm_eval (no download at run time): a generation
task (greedy answers, exact match) and a multiple-choice task (each choice scored by its loglikelihood, which
lm-eval asks for with `echo` + `logprobs`). The harness runs through; its answers are the server's own greedy
answers to the token ids it sends; its loglikelihoods are transformers' log_softmax sums; TP 1 and TP 2 give
the same answers and the same scores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
GEN, MC = "lockstep_tiny_qa", "lockstep_tiny_mc"
MODEL = "tiny"
TOL = 1e-3  # a sum of a few logprobs, each within 1e-4 of transformers'


def _evaluate(url: str, tokenizer_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=120")
    return simple_evaluate(model="local-completions", model_args=model_args, tasks=[GEN, MC],
                           task_manager=TaskManager(include_path=str(FIXTURES)), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def _direct_answer(url: str, context: str) -> str:
    """What the server answers to the ids lm-eval sends (the context without special tokens), greedy."""
    from cluster import http

    status, tokens = http("POST", url + "/tokenize", {"prompt": context, "add_special_tokens": False})
    assert status == 200, tokens
    status, done = http("POST", url + "/v1/completions", {"prompt": tokens["tokens"], "max_tokens": 8,
                                                          "temperature": 0, "stop": ["\n"]})
    assert status == 200, done
    return done["choices"][0]["text"]


def _reference_loglikelihood(tiny_llama: Path):
    """(context, continuation) -> transformers' sum of log_softmax over the continuation's tokens, split as
    lm-eval splits them (the context's ids, then the whole's ids past them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_llama)

    def run(context: str, continuation: str) -> float:
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
        return sum(ref[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))

    return run


def test_lm_eval_tasks_tp1_and_tp2_agree(tiny_llama, tmp_path, monkeypatch):
    from cluster import Cluster

    monkeypatch.chdir(FIXTURES)  # the tasks' data_files are relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reference = _reference_loglikelihood(tiny_llama)
    runs = {}
    for tp in (1, 2):
        c = Cluster(tiny_llama, tp=tp, kv_pages=64, log_dir=tmp_path,
                    coordinator_args=["--served-model-name", MODEL])
        try:
            out = _evaluate(c.url, tiny_llama)
            gen = sorted(out["samples"][GEN], key=lambda s: s["doc_id"])
            assert len(gen) == len((FIXTURES / "tiny_qa.jsonl").read_text().splitlines())
            answers = [s["resps"][0][0] for s in gen]
            assert any(a.strip() for a in answers), answers  # text to compare, not empty answers
            mc = sorted(out["samples"][MC], key=lambda s: s["doc_id"])
            assert len(mc) == len((FIXTURES / "tiny_mc.jsonl").read_text().splitlines())
            scores = [[r[0][0] for r in s["resps"]] for s in mc]  # each choice's loglikelihood
            if tp == 1:
                assert answers == [_direct_answer(c.url, s["arguments"][0][0]) for s in gen]
                for s, lls in zip(mc, scores, strict=True):
                    want = [reference(ctx, cont) for ctx, cont in s["arguments"]]
                    assert lls == pytest.approx(want, abs=TOL), s["arguments"]
            acc = [float(max(range(len(lls)), key=lls.__getitem__) == s["target"]) for s, lls in zip(mc, scores,
                                                                                                     strict=True)]
            assert out["results"][MC]["acc,none"] == pytest.approx(sum(acc) / len(acc))
            em = out["results"][GEN]["exact_match,none"]
            assert em == pytest.approx(sum(s["exact_match"] for s in gen) / len(gen))
            runs[tp] = (answers, em, out["results"][MC]["acc,none"], out["results"][MC]["acc_norm,none"], scores)
            c.assert_no_leak()
        finally:
            c.close()
    print(f"lm-eval: {GEN} exact_match tp1 {runs[1][1]} tp2 {runs[2][1]}; {MC} acc tp1 {runs[1][2]} tp2 {runs[2][2]}, "
          f"acc_norm tp1 {runs[1][3]} tp2 {runs[2][3]}")
    assert runs[1][:4] == runs[2][:4]
    for one, two in zip(runs[1][4], runs[2][4], strict=True):
        assert one == pytest.approx(two, abs=TOL)
