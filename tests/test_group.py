"""The served group end to end: `lockstep rank` processes, a `lockstep coordinator`, real gRPC and gloo."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from checkpoints import random_prompt as prompt
from cluster import Cluster, hf_greedy, http, tokens_of

PS = 16



@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_greedy(tiny_llama)


@pytest.fixture(scope="module")
def group(tiny_llama, tmp_path_factory):
    c = Cluster(tiny_llama, tp=2, kv_pages=128, log_dir=tmp_path_factory.mktemp("logs"),
                coordinator_args=["--stall-threshold", "1", "--dead-rank-timeout", "20"])
    yield c
    c.close()


def test_concurrent_greedy_matches_transformers(group, reference, no_leak):
    prompts = [prompt(i, n) for i, n in enumerate([5, 17, 33, 48, 70, 9])]
    hidden = sum(group.metric("lockstep_coordinator_seconds_total", part="hidden"))
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: tokens_of(group, p, 10)[0], prompts))
    for p, got in zip(prompts, results, strict=True):
        assert got == reference(p, 10)
    # the decodes ran on plans built ahead (overlap scheduling): the coordinator's time was hidden behind them
    assert sum(group.metric("lockstep_coordinator_seconds_total", part="hidden")) > hidden


def test_without_overlap_every_plan_waits_for_reports_and_outputs_are_the_same(tiny_llama, reference, tmp_path):
    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path, coordinator_args=["--no-overlap"])
    try:
        prompts = [prompt(200 + i, n) for i, n in enumerate([7, 30, 19])]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: tokens_of(c, p, 8)[0], prompts))
        assert results == [reference(p, 8) for p in prompts]
        status, log = http("GET", c.url + "/admin/steps")
        assert status == 200 and log["steps"] and all(s[6] == 0 for s in log["steps"])  # no plan built ahead
        # what is hidden is only the handing of each step's tokens to their clients, after the next plan went out
        delivered = sum(s[7] for s in log["steps"])
        assert sum(c.metric("lockstep_coordinator_seconds_total", part="hidden")) == pytest.approx(delivered, abs=1e-6)
        assert sum(c.metric("lockstep_coordinator_seconds_total", part="exposed")) > 0
        c.assert_no_leak()
    finally:
        c.close()


def test_prefix_cache_hit_is_skipped_and_output_unchanged(group, reference, no_leak):
    p = prompt(100, 45)
    cold, body_cold = tokens_of(group, p, 6)
    before = sum(group.metric("lockstep_prefix_cache_hit_tokens_total"))
    warm, body_warm = tokens_of(group, p, 6)
    assert cold == warm == reference(p, 6)
    assert body_cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body_warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert sum(group.metric("lockstep_prefix_cache_hit_tokens_total")) - before == 32
    assert body_warm["prompt_token_ids"] == p


def test_same_prefix_admitted_together_both_correct(group, reference, no_leak):
    shared = prompt(200, 32)
    tokens_of(group, shared + prompt(201, 3), 1)
    a, b = shared + prompt(202, 7), shared + prompt(203, 12)
    with ThreadPoolExecutor(2) as pool:
        ra, rb = pool.map(lambda p: tokens_of(group, p, 8), [a, b])
    assert ra[0] == reference(a, 8) and rb[0] == reference(b, 8)
    assert ra[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert rb[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_flushed_rank_agrees_at_its_minimum(group, reference, no_leak):
    p = prompt(300, 50)
    tokens_of(group, p, 2)
    status, _ = http("POST", group.url + "/admin/reset_prefix_cache?rank=1")
    assert status == 200
    offered_before = group.metric("lockstep_prefix_offered_pages_total", rank="0")
    got, body = tokens_of(group, p, 6)
    assert got == reference(p, 6)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert group.metric("lockstep_prefix_offered_pages_total", rank="0")[0] > offered_before[0]
    assert max(group.metric("lockstep_free_page_skew_pages")) > 0


def test_bad_input_is_a_4xx_and_service_stays_up(group, no_leak):
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(), 404, "model"),
        (json.dumps({"prompt": list(range(3, 250)) * 20}).encode(), 400, "prompt"),
        (json.dumps({"prompt": [1, 2, 10**9]}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "hi", "n": 17}).encode(), 400, "n"),
        (json.dumps({"messages": "hello"}).encode(), 400, "messages"),
        (json.dumps({"prompt": "hi", "seed": 2**64}).encode(), 400, "seed"),
        (json.dumps({"prompt": "hi", "top_k": 2**40}).encode(), 400, "top_k"),
    ]
    for raw, status, param in cases:
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        got, body = http("POST", group.url + path, raw)
        assert got == status, (raw, body)
        assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"]
        assert body["error"]["param"] == param
    got, body = group.complete({"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert got == 200 and body["usage"]["completion_tokens"] <= 3


def test_chat_and_streaming(group, no_leak):
    status, body = http("POST", group.url + "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    req = urllib.request.Request(group.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt(400, 10), "max_tokens": 5, "stream": True,
                                                  "temperature": 0, "ignore_eos": True,
                                                  "return_token_ids": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [ln.decode().strip() for ln in resp if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(ids) == 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed, _ = tokens_of(group, prompt(400, 10), 5)
    assert ids == streamed


def test_admin_steps_is_the_group_step_log(group, no_leak):
    status, before = http("GET", group.url + "/admin/steps?group=g0")
    assert status == 200 and before["group"] == "g0" and before["next"] == len(before["steps"])
    tokens_of(group, prompt(450, 10), 3)
    status, after = http("GET", group.url + f"/admin/steps?since={before['next']}")
    assert status == 200 and after["group"] == "g0" and after["next"] >= before["next"] + 3
    assert len(after["steps"]) == after["next"] - before["next"]
    assert all(len(s) == 8 and s[0] >= 0 and min(s[1:]) >= 0 for s in after["steps"])
    assert any(s[6] > 0 for s in after["steps"])  # a decode planned while the step before it ran (overlap)
    assert any(s[0] >= 1 for s in after["steps"])  # the request's steps had it in their batch
    status, body = http("GET", group.url + "/admin/steps?group=nope")
    assert status == 404 and body["error"]["param"] == "group"


def test_client_disconnect_aborts_and_frees_pages(group, no_leak):
    before = sum(group.metric("lockstep_generation_tokens_total"))
    body = json.dumps({"prompt": prompt(500, 20), "max_tokens": 480, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(group.url + "/v1/completions", method="POST", data=body,
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    resp.readline()
    resp.close()
    group.assert_no_leak()
    generated = sum(group.metric("lockstep_generation_tokens_total")) - before
    assert 1 <= generated < 480, f"the request ran on after its client left ({generated} tokens)"


def test_stopped_rank_stalls_then_group_continues(group, reference, no_leak):
    p = prompt(600, 20)
    with ThreadPoolExecutor(1) as pool:
        os.kill(group.ranks[1].pid, signal.SIGSTOP)
        try:
            fut = pool.submit(tokens_of, group, p, 8)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and group.metric("lockstep_agreements_stalled")[0] < 1:
                time.sleep(0.2)
            assert group.metric("lockstep_agreements_stalled") == [1.0]
            log = group.log(group.coordinator)
            assert "agreement wait stalled" in log and "not responding at all: [1]" in log
        finally:
            os.kill(group.ranks[1].pid, signal.SIGCONT)
        assert fut.result(timeout=60)[0] == reference(p, 8)
    assert group.metric("lockstep_agreements_stalled") == [0.0]
    assert group.metric("lockstep_agreement_stalls_total")[0] >= 1


def test_smaller_pool_on_one_rank_preempts_and_completes(tiny_llama, reference, tmp_path):
    c = Cluster(tiny_llama, tp=2, kv_pages=[128, 10], log_dir=tmp_path)
    try:
        prompts = [prompt(700 + i, 30) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: tokens_of(c, p, 24)[0], prompts))
        for p, got in zip(prompts, results, strict=True):
            assert got == reference(p, 24)
        assert sum(c.metric("lockstep_preemptions_total")) > 0
        status, body = c.complete({"prompt": prompt(799, 30), "max_tokens": 200, "ignore_eos": True})
        assert status == 400 and body["error"]["code"] == "request_too_large", body
        assert "smallest rank pool holds 10" in body["error"]["message"]
        status, body = c.complete({"prompt": prompt(799, 30), "max_tokens": 200, "ignore_eos": True, "stream": True})
        assert status == 400 and body["error"]["code"] == "request_too_large", body  # a status, not a 200 stream
        status, body = c.complete({"prompt": prompt(798, 30), "ignore_eos": True})  # no max_tokens: what fits
        assert status == 200 and body["usage"]["completion_tokens"] == 10 * 16 - 30, body
        assert "refused by the ranks" not in c.log(c.coordinator), "a rank was asked for more than it had"
        c.assert_no_leak()
    finally:
        c.close()


def test_killed_rank_fails_requests_with_503_then_a_new_group_serves(tiny_llama, tmp_path):
    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path,
                coordinator_args=["--stall-threshold", "1", "--dead-rank-timeout", "5", "--replay-timeout", "0"])
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.complete, {"prompt": prompt(800, 10), "max_tokens": 480, "ignore_eos": True})
            deadline = time.monotonic() + 20  # in flight: generating (a fixed wait could outlast its 480 tokens)
            while time.monotonic() < deadline and not sum(c.metric("lockstep_generation_tokens_total")):
                time.sleep(0.05)
            os.kill(c.ranks[1].pid, signal.SIGKILL)
            t0 = time.monotonic()
            status, body = fut.result(timeout=30)
        assert status == 503, body
        assert time.monotonic() - t0 < 10
        assert body["error"]["type"] == "service_unavailable"
        status, _ = http("GET", c.url + "/health")
        assert status == 503
        assert c.metric("lockstep_rank_up", rank="1") == [0.0] and c.metric("lockstep_rank_up", rank="0") == [1.0]
        assert c.metric("lockstep_requests_dropped_total") == [1.0]  # the default --replay-timeout 0 drops it
        status, body = c.complete({"prompt": "hi", "max_tokens": 2})
        assert status == 503
        status, body = c.complete({"prompt": "hi", "max_tokens": 2, "stream": True})
        assert status == 503 and body["error"]["code"] == "group_unavailable"
        assert c.ranks[0].wait(timeout=30) == 3, "the surviving rank served on with a broken group"
        assert "exiting so that the group is recreated" in c.log(c.ranks[0])
        c.start_ranks()
        c.wait_healthy()
        status, body = c.complete({"prompt": prompt(801, 10), "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        c.assert_no_leak()
    finally:
        c.close()


def _restart_exited(c: Cluster, exits: list[tuple[int, int]]) -> None:
    """Start again, with its same command line, every rank of g0 that exited: what a per-rank supervisor does
    (systemd's Restart=always, a container's restart policy), unlike the operator, which recreates the group."""
    for r, proc in enumerate(c.ranks):
        if proc.poll() is not None:
            exits.append((r, proc.returncode))
            c.ranks[r] = c._spawn(list(proc.args), c._env(), f"g0-rank{r}-again")


def test_a_rank_restarted_alone_while_no_coordinator_drove_the_group_is_taken_back(tiny_llama, tmp_path):
    """Found by a helper: rank 1 killed and started again with its same command line while the coordinator was
    away (restarting). Rank 0 served on, idle, in a group that had lost rank 1, for ever (nothing drove it into a
    collective that would fail); the new rank 1 waited at the rendezvous, which only the old rank 0's store
    answered; the new coordinator said "rank 1 is still loading its engine" for ever. Now the new rank 1 finds
    the old group's mark in the store and tells it; rank 0 exits 3 and, started again, forms a new group."""
    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path, coordinator_args=["--dead-rank-timeout", "3"])
    exits: list[tuple[int, int]] = []
    try:
        before, _ = tokens_of(c, prompt(820, 12), 6)
        c.coordinator.kill()
        c.coordinator.wait()
        c.ranks[1].kill()
        c.ranks[1].wait()
        _restart_exited(c, exits)
        time.sleep(3.0)  # the new rank 1 reaches the rendezvous, where only the old rank 0's store answers
        c.start_coordinator()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            _restart_exited(c, exits)
            try:
                if http("GET", c.url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError(f"the group never came back (exits {exits}):\n{c.log(c.coordinator)[-3000:]}")
        assert (1, -signal.SIGKILL) in exits and (0, 3) in exits, exits  # rank 0 left the broken group
        assert tokens_of(c, prompt(820, 12), 6)[0] == before
        c.assert_no_leak()
    finally:
        c.close()


def test_grpc_inference_service(group, reference, no_leak):
    import grpc

    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
    from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc

    p = prompt(900, 21)
    with grpc.insecure_channel(f"127.0.0.1:{group.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=p), max_tokens=6, temperature=0,
                                  return_token_ids=True)
        unary = stub.Complete(req, timeout=60)
        assert list(unary.token_ids) == reference(p, 6)[: len(unary.token_ids)]
        assert unary.usage.prompt_tokens == len(p) and unary.finish_reason in ("length", "stop")
        streamed = [t for msg in stub.Generate(req, timeout=60) for t in msg.token_ids]
        assert streamed == list(unary.token_ids)
        slow = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=p), max_tokens=300, request_id="mine", ignore_eos=True)
        stream = stub.Generate(slow, timeout=60)
        next(stream)
        try:
            stub.Complete(ipb.GenerateRequest(text="hi", max_tokens=2, request_id="mine"), timeout=10)
            raise AssertionError("a request id in use was accepted")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.ALREADY_EXISTS
        stream.cancel()
        try:
            stub.Complete(ipb.GenerateRequest(text="hi", max_tokens=0), timeout=10)
            raise AssertionError("max_tokens=0 was accepted")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in exc.details()


def test_cache_off_gives_the_same_outputs_and_never_skips(tiny_llama, reference, tmp_path):
    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path, prefix_caching=False)
    try:
        p = prompt(100, 45)
        for _ in range(2):
            got, body = tokens_of(c, p, 6)
            assert got == reference(p, 6)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert sum(c.metric("lockstep_prefix_offered_pages_total")) == 0
        c.assert_no_leak()
    finally:
        c.close()


def test_seeded_sampling_is_reproducible(group, no_leak):
    body = {"prompt": prompt(1000, 12), "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50,
            "ignore_eos": True, "return_token_ids": True}
    runs = [group.complete({**body, "seed": seed})[1]["choices"][0]["token_ids"] for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[0]) == 16
    assert runs[0] != runs[2]
