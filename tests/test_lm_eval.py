"""lm-evaluation-harness (`local-completions`, the way evaluation users drive a vLLM-compatible server) against
a served group, on a generation task whose data ships in tests/fixtures/lm_eval (no download at run time):
the harness runs through, its answers are the server's own greedy answers to the token ids it sends, and
TP 1 and TP 2 give the same answers and the same score.

Slow (two groups, the harness's start-up). lm-eval is not in the test extra: its table writer needs
python-dateutil < 3, and kubernetes >= 37 needs >= 3; the test runs where lm-eval is installed beside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"
TASK = "lockstep_tiny_qa"
MODEL = "tiny"


def _evaluate(url: str, tokenizer_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=120")
    return simple_evaluate(model="local-completions", model_args=model_args, tasks=[TASK],
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


def test_lm_eval_generation_task_tp1_and_tp2_agree(tiny_llama, tmp_path, monkeypatch):
    from cluster import Cluster

    monkeypatch.chdir(FIXTURES)  # the task's data_files is relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lines = (FIXTURES / "tiny_qa.jsonl").read_text().splitlines()
    runs = {}
    for tp in (1, 2):
        c = Cluster(tiny_llama, tp=tp, kv_pages=64, log_dir=tmp_path,
                    coordinator_args=["--served-model-name", MODEL])
        try:
            out = _evaluate(c.url, tiny_llama)
            samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
            assert len(samples) == len(lines)
            answers = [s["resps"][0][0] for s in samples]
            assert any(a.strip() for a in answers), answers  # text to compare, not empty answers
            if tp == 1:
                assert answers == [_direct_answer(c.url, s["arguments"][0][0]) for s in samples]
            score = out["results"][TASK]["exact_match,none"]
            assert score == pytest.approx(sum(s["exact_match"] for s in samples) / len(samples))
            runs[tp] = (answers, score)
            c.assert_no_leak()
        finally:
            c.close()
    print(f"lm-eval {TASK}: exact_match tp1 {runs[1][1]}, tp2 {runs[2][1]}")
    assert runs[1] == runs[2]
