"""Two hybrid groups (Gemma 3 style: `full` and `sliding` pools) under one coordinator: each decides and carries out
its own rebalances on its own workload (DESIGN.md "Rebalance agreement": data-parallel replicas decide
independently), a rebalance of one never moves the other's pools, outputs are the transformers reference, and a
group killed while the other rebalances leaves the other's rebalances and requests alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from checkpoints import random_prompt
from cluster import Cluster, http

ARGS = ["--rebalance-interval-steps", "2", "--rebalance-cooldown", "0", "--rebalance-min-samples", "3",
        "--rebalance-threshold", "1.1"]
LONG = [random_prompt(100 + i, 200) for i in range(4)]  # 50 full pages each at page size 4, a window of 3
SHORT = [random_prompt(200 + i, 8) for i in range(6)]


def hf_greedy(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def complete(c: Cluster, prompt: list[int], n: int = 8) -> list[int]:
    status, body = c.complete({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def pool_totals(c: Cluster, group: str) -> dict[tuple[str, str], float]:
    return {(r, p): c.metric("lockstep_rank_pool_pages", group=group, rank=r, pool=p)[0] for r in "01"
            for p in ("full", "sliding")}


def wait_up(c: Cluster, timeout: float = 120.0) -> None:
    """Cluster waits for some group; these tests need both."""
    deadline = time.monotonic() + timeout
    while not all(g["up"] for g in http("GET", c.url + "/health")[1].values()):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, http("GET", c.url + "/health")
        time.sleep(0.1)


def only(c: Cluster, group: str) -> None:
    """Route new requests to `group` alone: the other is drained (it holds nothing here)."""
    other = "g1" if group == "g0" else "g0"
    assert http("POST", f"{c.url}/admin/resume?group={group}")[0] == 200
    assert http("POST", f"{c.url}/admin/drain?group={other}")[0] == 200


def rebalances(c: Cluster) -> dict[str, float]:
    return {g: sum(c.metric("lockstep_rebalances_total", group=g)) for g in ("g0", "g1")}


def test_two_hybrid_groups_rebalance_on_their_own_and_a_dead_one_leaves_the_other_alone(checkpoint_dir, tmp_path):
    model = checkpoint_dir("gemma3_hybrid")
    want = dict(zip(map(tuple, LONG + SHORT), hf_greedy(model, LONG + SHORT, 8), strict=True))
    c = Cluster(model, tp=2, kv_pages=64, page_size=4, log_dir=tmp_path, groups=2, coordinator_args=ARGS)
    try:
        wait_up(c)
        only(c, "g0")
        with ThreadPoolExecutor(3) as ex:
            assert list(ex.map(lambda p: complete(c, p), LONG)) == [want[tuple(p)] for p in LONG]
        assert rebalances(c) == {"g0": 1, "g1": 0}
        g0 = pool_totals(c, "g0")
        assert g0[("0", "full")] > 3 * g0[("0", "sliding")] and g0[("0", "full")] == g0[("1", "full")]
        only(c, "g1")
        with ThreadPoolExecutor(3) as ex:
            assert list(ex.map(lambda p: complete(c, p), SHORT)) == [want[tuple(p)] for p in SHORT]
        assert rebalances(c) == {"g0": 1, "g1": 1}
        assert pool_totals(c, "g0") == g0 and pool_totals(c, "g1") != g0  # its own split, and g0's untouched
        log = c.log(c.coordinator)
        assert log.count("group g0: rebalanced") == 1 and log.count("group g1: rebalanced") == 1

        # g0 rebalances back and forth while g1 (holding nothing new) loses a rank
        only(c, "g0")
        done: list[bool] = []

        def load() -> None:
            for k in range(6):
                batch = LONG if k % 2 else SHORT
                with ThreadPoolExecutor(3) as ex:
                    done.append(list(ex.map(lambda p: complete(c, p), batch)) == [want[tuple(p)] for p in batch])

        t = threading.Thread(target=load)
        t.start()
        deadline = time.monotonic() + 120
        while rebalances(c)["g0"] < 2 and time.monotonic() < deadline:  # g0 is rebalancing: now g1 goes down
            time.sleep(0.01)
        c.group_ranks[1][1].kill()
        t.join(timeout=240)
        assert not t.is_alive() and done == [True] * 6
        assert rebalances(c)["g0"] >= 4  # the shifts kept moving g0's split, g1 down or not
        c.assert_clean()
        for (rank, pool), total in pool_totals(c, "g0").items():
            pages = {s: c.metric("lockstep_rank_pages", group="g0", rank=rank, pool=pool, state=s)[0]
                     for s in ("free", "evictable", "used", "fenced")}
            assert pages["free"] + pages["evictable"] == total and pages["used"] == pages["fenced"] == 0
    finally:
        c.close()
