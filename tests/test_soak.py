"""A mixed load on a group whose ranks differ (one small pool, flushes mid-load): everything the API
offers at once, then the invariants — every request answered right, no refused step, no leaked page."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from checkpoints import random_prompt
from cluster import Cluster, http


def _stream(url: str, body: dict, hang_up_after: int | None) -> tuple[list[int], str | None]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({**body, "stream": True, "return_token_ids": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    ids: list[int] = []
    reason = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            ids.extend(chunk["choices"][0]["token_ids"])
            reason = chunk["choices"][0]["finish_reason"] or reason
            if hang_up_after is not None and len(ids) >= hang_up_after:
                return ids, "hung up"
    return ids, reason


@pytest.mark.parametrize("requests", [120, pytest.param(2000, marks=[pytest.mark.slow, pytest.mark.timeout(3600)])])
def test_mixed_load_on_divergent_ranks(tiny_llama, tmp_path, requests):
    c = Cluster(tiny_llama, tp=2, kv_pages=[96, 14], log_dir=tmp_path,
                coordinator_args=["--max-num-seqs", "12", "--max-num-batched-tokens", "96"])
    rng = random.Random(5)
    shared = [random_prompt(900 + i, 32) for i in range(3)]
    greedy: list[tuple[list[int], list[int]]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        base = shared[i % 3] if rng.random() < 0.6 else []
        tokens = base + random_prompt(1000 + i, rng.randint(1, 40))
        n = rng.randint(1, 40)
        kind = rng.choice(["greedy", "greedy", "seeded", "edge", "stream", "hangup"])
        body = {"prompt": tokens, "max_tokens": n, "ignore_eos": True}
        if kind == "seeded":
            body.update(temperature=0.8, top_p=0.9, seed=i)
        elif kind == "edge":  # the edges of every sampling range: none of them may break a step
            body.update(temperature=rng.choice([1e-30, 2.0, 5e-324]), top_p=rng.choice([1e-12, 1.0]),
                        top_k=rng.choice([-1, 0, 1, 1 << 30]), seed=rng.choice([-(1 << 63), (1 << 63) - 1]))
        else:
            body["temperature"] = 0
        if kind in ("stream", "hangup"):
            ids, reason = _stream(c.url, body, n // 2 if kind == "hangup" and n > 2 else None)
            if reason != "hung up":
                assert len(ids) == n and reason == "length"
        else:
            status, out = c.complete({**body, "return_token_ids": True})
            assert status == 200, out
            ids = out["choices"][0]["token_ids"]
            assert len(ids) == n and out["choices"][0]["finish_reason"] == "length"
        if kind in ("greedy", "stream") or (kind == "hangup" and len(ids) < n):
            with lock:
                greedy.append((tokens, ids))

    def flusher(stop: threading.Event) -> None:
        while not stop.wait(1.5):
            http("POST", c.url + f"/admin/reset_prefix_cache?rank={rng.randint(0, 1)}")

    stop = threading.Event()
    t = threading.Thread(target=flusher, args=(stop,), daemon=True)
    try:
        t.start()
        started = time.monotonic()
        with ThreadPoolExecutor(10) as pool:
            for f in [pool.submit(one, i) for i in range(requests)]:
                f.result(timeout=3600)
        stop.set()
        t.join()
        c.assert_no_leak()
        c.assert_request_table_empty()  # and the coordinator forgot every request, hung up or not
        log = c.log(c.coordinator)
        assert "refused by the ranks" not in log and "Traceback" not in log
        assert sum(c.metric("lockstep_preemptions_total")) > 0
        assert sum(c.metric("lockstep_prefix_cache_hit_tokens_total")) > 0
        assert sum(c.metric("lockstep_requests")) == 0 and sum(c.metric("lockstep_requests_dropped_total")) == 0
        assert c.metric("lockstep_rank_up") == [1.0, 1.0]  # nothing a request did took the group down
        print(f"{requests} mixed requests in {time.monotonic() - started:.1f} s, "
              f"{int(sum(c.metric('lockstep_preemptions_total')))} preemptions, "
              f"{int(sum(c.metric('lockstep_prefix_cache_hit_tokens_total')))} cached prompt tokens")
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        for tokens, ids in greedy:
            want = ref.generate(torch.tensor([tokens]), max_new_tokens=len(ids), eos_token_id=None,
                                do_sample=False)[0, len(tokens):].tolist()
            if ids != want:
                i = next(j for j, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b)
                logits = ref(torch.tensor([tokens + want[:i]])).logits[0, -1]
                top = torch.topk(logits, 3)
                raise AssertionError(f"prompt of {len(tokens)}, {len(ids)} tokens, first diff at {i}: ours {ids[i]} "
                                     f"(logit {logits[ids[i]].item():.6f}), ref {want[i]}; top {top}")
    finally:
        stop.set()
        c.close()
