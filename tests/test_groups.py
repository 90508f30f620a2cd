"""A coordinator over several groups, and over ranks that outlive it."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

from checkpoints import random_prompt as prompt
from cluster import Cluster, http


def complete(c: Cluster, tokens: list[int], n: int) -> dict:
    status, body = c.complete({"prompt": tokens, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True})
    assert status == 200, body
    return body


def wait_groups_up(c: Cluster, names: set[str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, detail = http("GET", c.url + "/health")
        if {n for n, g in detail.items() if g["up"]} == names or time.monotonic() > deadline:
            return detail
        time.sleep(0.3)


def test_new_coordinator_releases_what_the_old_one_left(tiny_llama, tmp_path):
    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path)
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(http, "POST", c.url + "/v1/completions",
                        {"prompt": prompt(1, 40), "max_tokens": 400, "ignore_eos": True}, 30)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and sum(c.metric("lockstep_rank_pages", state="used")) == 0:
                time.sleep(0.1)
            assert sum(c.metric("lockstep_rank_pages", state="used")) > 0
            c.coordinator.send_signal(signal.SIGKILL)
            c.coordinator.wait()
        c.start_coordinator()
        c.wait_healthy()
        first = complete(c, prompt(2, 20), 6)
        c.assert_no_leak()
        again = complete(c, prompt(2, 20), 6)
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        c.assert_no_leak()
    finally:
        c.close()


def test_requests_spread_over_groups_and_one_down_group_does_not_stop_the_other(tiny_llama, tmp_path):
    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path, groups=2)
    try:
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        prompts = [prompt(10 + i, 12) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: complete(c, p, 12)["choices"][0]["token_ids"], prompts))
        assert all(len(o) == 12 for o in outs)
        per_group = {g: sum(c.metric("lockstep_generation_tokens_total", group=g)) for g in ("g0", "g1")}
        assert per_group["g0"] > 0 and per_group["g1"] > 0, per_group
        assert sum(per_group.values()) == 8 * 12

        c.group_ranks[1][0].kill()
        detail = wait_groups_up(c, {"g0"})
        assert not detail["g1"]["up"] and detail["g0"]["up"]
        assert http("GET", c.url + "/health")[0] == 200
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda p: complete(c, p, 12)["choices"][0]["token_ids"], prompts[:4]))
        assert again == outs[:4]

        c.start_ranks(1)
        assert wait_groups_up(c, {"g0", "g1"})["g1"]["up"]
        assert complete(c, prompts[5], 12)["choices"][0]["token_ids"] == outs[5]
        c.assert_no_leak()
    finally:
        c.close()


def test_requests_of_a_dead_group_are_replayed_on_another(tiny_llama, tmp_path):
    """Killing the group that runs a request mid-generation: the request finishes on the other group,
    with every token it was asked for, the same greedy tokens as an undisturbed run, and no leak."""
    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path, groups=2,
                coordinator_args=["--dead-rank-timeout", "5"])
    try:
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        p = prompt(50, 20)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, c, p, 300)
            deadline = time.monotonic() + 20
            running = {}
            while time.monotonic() < deadline:
                running = {g: sum(c.metric("lockstep_requests", group=g, state="running")) for g in ("g0", "g1")}
                if any(running.values()):
                    break
                time.sleep(0.05)
            victim = 0 if running.get("g0") else 1
            time.sleep(0.3)
            c.group_ranks[victim][0].kill()
            body = fut.result(timeout=60)
        assert len(body["choices"][0]["token_ids"]) == 300
        assert f"moves from group g{victim} to g{1 - victim}" in c.log(c.coordinator)
        assert c.metric("lockstep_requests_migrated_total", group=f"g{victim}") == [1.0]
        assert c.metric("lockstep_routing_decisions_total", group=f"g{1 - victim}", reason="replay") == [1.0]
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0
        undisturbed = complete(c, p, 300)["choices"][0]["token_ids"]
        assert body["choices"][0]["token_ids"] == undisturbed
    finally:
        c.close()


def test_a_single_group_keeps_its_requests_until_it_is_whole_again(tiny_llama, tmp_path):
    """With --replay-timeout, a request whose only group dies waits for the group to be recreated and
    then finishes with every token, the same as an undisturbed run."""
    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path,
                coordinator_args=["--dead-rank-timeout", "5", "--replay-timeout", "60"])
    try:
        p = prompt(60, 20)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, c, p, 300)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not sum(c.metric("lockstep_generation_tokens_total")):
                time.sleep(0.05)
            c.ranks[0].kill()
            c.ranks[0].wait()
            time.sleep(1.0)
            assert not fut.done()
            c.start_ranks(0)
            body = fut.result(timeout=90)
        assert len(body["choices"][0]["token_ids"]) == 300
        assert body["choices"][0]["token_ids"] == complete(c, p, 300)["choices"][0]["token_ids"]
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0
        assert c.metric("lockstep_routing_decisions_total", group="g0", reason="least_loaded") == [2.0]
        c.assert_no_leak()
    finally:
        c.close()
