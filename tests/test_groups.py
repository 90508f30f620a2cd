"""A coordinator over several groups, and over ranks that outlive it."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from checkpoints import random_prompt as prompt
from cluster import Cluster, http
from lockstep import wire
from lockstep.proto_gen.lockstep.v1 import rank_pb2, rank_pb2_grpc
from lockstep.rank_auth import TOKEN_METADATA_KEY
from lockstep.steps import Plan
from lockstep.stream_metadata import STREAM_TAKEN_METADATA


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


def take_over(stub: rank_pb2_grpc.RankServiceStub, auth: tuple, plan: rank_pb2.PlanMsg,
              done: threading.Event, timeout: float = 20.0) -> grpc.Future:
    """A Step stream that sends `plan` and then stays open until `done`. The killed coordinator's stream
    still holds the rank until its server notices the closed connection, and a stream of another
    coordinator is refused meanwhile: open it again until the rank takes it."""
    def plans():
        yield plan
        done.wait()

    deadline = time.monotonic() + timeout
    while True:
        call = stub.Step(plans(), metadata=auth)
        if STREAM_TAKEN_METADATA in tuple(call.initial_metadata() or ()):
            return call
        assert call.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, call.details()
        time.sleep(0.1)


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


def test_a_new_coordinator_catches_up_a_rank_left_one_step_behind(tiny_llama, tmp_path):
    """A coordinator killed between writing plan k to one rank and to the next leaves the first rank waiting
    in step k's agreement collective for a peer that never comes. The next coordinator used to wait for a
    recreation of the group that nothing would ever do; now the ranks one step behind abstain from step k,
    so the group skips it together and is served again."""
    c = Cluster(tiny_llama, tp=2, kv_pages=64, log_dir=tmp_path)
    sent = threading.Event()
    channel = grpc.insecure_channel(f"127.0.0.1:{c.rank_ports[0]}")
    try:
        first = complete(c, prompt(3, 20), 4)
        c.coordinator.send_signal(signal.SIGKILL)
        c.coordinator.wait()
        stub = rank_pb2_grpc.RankServiceStub(channel)
        auth = ((TOKEN_METADATA_KEY, c.token),)
        step = stub.Info(rank_pb2.InfoRequest(), timeout=5, metadata=auth).last_step + 1

        call = take_over(stub, auth, wire.plan_to_proto(Plan(step=step)), sent)  # to rank 0 only, as a
        deadline = time.monotonic() + 20  # coordinator killed mid-write; kept: a dropped call is cancelled
        while stub.Info(rank_pb2.InfoRequest(), timeout=5, metadata=auth).last_step != step \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stub.Info(rank_pb2.InfoRequest(), timeout=5, metadata=auth).last_step == step
        sent.set()  # the killed coordinator's side of its stream ends (its process is gone): the rank is free
        c.start_coordinator()
        c.wait_healthy(timeout=60)
        assert complete(c, prompt(3, 20), 4)["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert f"one step behind: ranks [1] abstain from step {step}" in c.log(c.coordinator)
        c.assert_no_leak()
        call.cancel()
    finally:
        sent.set()
        channel.close()
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


MANY = 480  # tokens: 20 + 480 positions fit the model's 512 and 64 pages of 16


def test_requests_of_a_dead_group_are_replayed_on_another(tiny_llama, tmp_path):
    """Killing the group that runs a request mid-generation: the request finishes on the other group,
    with every token it was asked for, the same greedy tokens as an undisturbed run, and no leak."""
    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path, groups=2,
                coordinator_args=["--dead-rank-timeout", "5"])
    try:
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        p = prompt(50, 20)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, c, p, MANY)  # long enough that a quiet machine is still at it
            deadline = time.monotonic() + 20
            running = {}
            while time.monotonic() < deadline:
                running = {g: sum(c.metric("lockstep_requests", group=g, state="running")) for g in ("g0", "g1")}
                if any(running.values()):
                    break
                time.sleep(0.02)
            victim = 0 if running.get("g0") else 1
            time.sleep(0.1)  # some tokens generated: the replay must keep them
            c.group_ranks[victim][0].kill()
            body = fut.result(timeout=60)
        assert len(body["choices"][0]["token_ids"]) == MANY
        assert f"moves from group g{victim} to g{1 - victim}" in c.log(c.coordinator)
        assert c.metric("lockstep_requests_migrated_total", group=f"g{victim}") == [1.0]
        assert c.metric("lockstep_routing_decisions_total", group=f"g{1 - victim}", reason="replay") == [1.0]
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0
        undisturbed = complete(c, p, MANY)["choices"][0]["token_ids"]
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


def test_past_max_waiting_requests_new_requests_get_503_with_retry_after(tiny_llama, tmp_path):
    """Overload is an answer, not a queue that grows for ever: past --max-waiting-requests a new request is
    refused with 503 and Retry-After, and the queued ones still finish."""
    import json
    import urllib.error
    import urllib.request

    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path,
                coordinator_args=["--max-num-seqs", "1", "--max-waiting-requests", "1"])
    try:
        with ThreadPoolExecutor(2) as pool:
            futs = []
            for i, state in enumerate(("running", "waiting")):  # one running (max_num_seqs 1), one waiting
                futs.append(pool.submit(complete, c, prompt(70 + i, 20), 480))  # busy long enough to see both
                deadline = time.monotonic() + 20
                while sum(c.metric("lockstep_requests", state=state)) < 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
            req = urllib.request.Request(c.url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=30)
                raise AssertionError("an overloaded coordinator took the request")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and int(exc.headers["Retry-After"]) >= 1
                assert json.loads(exc.read())["error"]["code"] == "server_overloaded"
            assert c.metric("lockstep_requests_rejected_total", reason="server_overloaded") == [1.0]
            assert all(len(f.result(timeout=120)["choices"][0]["token_ids"]) == 480 for f in futs)
        c.assert_no_leak()
    finally:
        c.close()


def test_drain_lets_a_group_finish_what_it_holds_and_resume_takes_it_back(tiny_llama, tmp_path):
    """POST /admin/drain?group=G: G takes no new request, its running one finishes undisturbed, and the
    call answers 200 only once G holds nothing; /admin/resume routes to it again."""
    c = Cluster(tiny_llama, tp=1, kv_pages=64, log_dir=tmp_path, groups=2)
    try:
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        p = prompt(80, 20)
        # long enough to still run 0.3 s after the drain call (at 200 tokens a fast step loop finished first)
        n = 480  # of the tiny model's 512 positions, less the prompt
        undisturbed = complete(c, p, n)["choices"][0]["token_ids"]
        with ThreadPoolExecutor(2) as pool:
            fut = pool.submit(complete, c, p, n)
            deadline = time.monotonic() + 20
            running = {}
            while time.monotonic() < deadline and not any(running.values()):
                running = {g: sum(c.metric("lockstep_requests", group=g, state="running")) for g in ("g0", "g1")}
                time.sleep(0.02)
            busy = "g0" if running["g0"] else "g1"
            other = "g1" if busy == "g0" else "g0"
            drain = pool.submit(http, "POST", c.url + f"/admin/drain?group={busy}")
            time.sleep(0.3)
            assert not drain.done()  # the running request is still there
            before = c.metric("lockstep_routing_decisions_total", group=other, reason="least_loaded")
            for i in range(3):
                complete(c, prompt(90 + i, 10), 4)
            assert c.metric("lockstep_routing_decisions_total", group=other, reason="least_loaded")[0] == before[0] + 3
            status, body = drain.result(timeout=60)
            assert status == 200 and body["holds_nothing"] is True, body
            assert fut.result()["choices"][0]["token_ids"] == undisturbed
        assert sum(c.metric("lockstep_requests", group=busy)) == 0
        assert http("GET", c.url + "/health")[1][busy]["draining"] is True  # an operator that restarted reads it
        assert http("POST", c.url + f"/admin/resume?group={busy}") == (200, {"group": busy, "draining": False})
        assert http("GET", c.url + "/health")[1][busy]["draining"] is False
        status, body = http("POST", c.url + "/admin/drain?group=nope")
        assert status == 404 and body["error"]["code"] == "group_not_found"
        status, body = http("POST", c.url + f"/admin/drain?group={busy}&migrate=maybe")
        assert status == 400 and body["error"]["param"] == "migrate"
        with ThreadPoolExecutor(1) as pool:  # migrate=true: the running request moves at a step boundary
            fut = pool.submit(complete, c, p, n)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not sum(c.metric("lockstep_requests", state="running")):
                time.sleep(0.02)
            busy = "g0" if sum(c.metric("lockstep_requests", group="g0", state="running")) else "g1"
            t0 = time.monotonic()
            status, body = http("POST", c.url + f"/admin/drain?group={busy}&migrate=true")
            assert status == 200 and body["holds_nothing"] is True
            assert not fut.done() or time.monotonic() - t0 < 1  # it did not wait for the request to finish
            assert fut.result()["choices"][0]["token_ids"] == undisturbed
        assert c.metric("lockstep_requests_migrated_total", group=busy) == [1.0]
        http("POST", c.url + f"/admin/resume?group={busy}")
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0
        c.assert_no_leak()
    finally:
        c.close()


def _shared_prefix_run(c: Cluster, prefixes: list[list[int]], order: list[int], clients: int) -> list[int]:
    """Each prefix once, one at a time (so each goes where least-loaded routing puts it with both groups idle: to
    the smaller footprint, half of them to each group, whatever the machine's speed), then each request of `order`,
    a prefix and a suffix of its own, `clients` at a time; returns the cached prompt tokens of the latter."""
    def one(i: int) -> int:
        body = complete(c, prefixes[order[i]] + prompt(1000 + i, 8), 2)
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    for p in range(len(prefixes)):
        complete(c, prefixes[p] + prompt(800 + p, 8), 2)
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(len(order))))


def test_prefix_routing_keeps_a_prefix_on_one_group_and_hits_its_cache_far_more_than_least_loaded(
        tiny_llama, tmp_path):
    """8 prefixes of 8 pages, 12 requests each, fill more than a group's cache (40 pages) but half of them fit:
    least-loaded routing sends every prefix to both groups, which evict each other's prefixes; prefix routing
    keeps each prefix on the group it first went to, which keeps it cached, and counts those requests as
    `prefix`. A prefix also goes back to its group while that group is the busier one."""
    import random

    c = Cluster(tiny_llama, tp=1, kv_pages=40, log_dir=tmp_path, groups=2,
                coordinator_args=["--routing", "least-loaded"])
    try:
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        prefixes = [prompt(900 + p, 128) for p in range(8)]
        order = [p for p in range(8) for _ in range(12)]
        random.Random(3).shuffle(order)
        least = _shared_prefix_run(c, prefixes, order, clients=4)
        assert sum(c.metric("lockstep_routing_decisions_total", reason="prefix")) == 0
        assert http("POST", c.url + "/admin/reset_prefix_cache")[0] == 200
        c.coordinator.terminate()
        c.coordinator.wait(timeout=15)
        c.coordinator_args = ["--routing", "prefix"]
        c.start_coordinator()
        c.wait_healthy()
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        routed = _shared_prefix_run(c, prefixes, order, clients=4)
        hits = lambda cached: sum(n > 0 for n in cached)
        assert hits(routed) >= len(order) - 4, (routed, least)  # every prefix is on its group already: nearly all
        misses = lambda cached: len(order) - hits(cached)
        assert misses(least) >= 2 * misses(routed) and hits(routed) >= hits(least) + 16, (routed, least)
        by_reason = {r: sum(c.metric("lockstep_routing_decisions_total", reason=r)) for r in ("prefix", "least_loaded")}
        assert by_reason == {"prefix": len(order), "least_loaded": 8}, by_reason

        with ThreadPoolExecutor(2) as pool:  # a long request makes its prefix's group the busier one
            long = pool.submit(complete, c, prefixes[0] + prompt(2000, 8), 300)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not sum(c.metric("lockstep_requests", state="running")):
                time.sleep(0.02)
            busy = "g0" if sum(c.metric("lockstep_requests", group="g0", state="running")) else "g1"
            before = c.metric("lockstep_routing_decisions_total", group=busy, reason="prefix")[0]
            body = complete(c, prefixes[0] + prompt(2001, 8), 2)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
            assert c.metric("lockstep_routing_decisions_total", group=busy, reason="prefix")[0] == before + 1
            assert not long.done()
            long.result(timeout=120)
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0
        c.assert_no_leak()
    finally:
        c.close()


def test_a_prefix_the_ranks_evicted_behind_the_routers_back_shows_expected_above_agreed(tiny_llama, tmp_path):
    """The coordinator's routing map says a group holds a prefix; the group's ranks evicted it since (their own
    LRU, under other prompts: nothing the coordinator is told). The next request with that prefix still goes
    there, and `lockstep_routing_expected_hit_tokens_total` passes `lockstep_routing_agreed_hit_tokens_total`:
    what an operator watches to see the map go stale. While the map is right, the two agree."""
    c = Cluster(tiny_llama, tp=1, kv_pages=40, log_dir=tmp_path, groups=2)
    try:
        assert set(wait_groups_up(c, {"g0", "g1"})) == {"g0", "g1"}
        hot = prompt(700, 128)  # 8 pages
        complete(c, hot + prompt(701, 8), 1)
        home = "g0" if c.metric("lockstep_routing_decisions_total", group="g0", reason="least_loaded")[0] else "g1"
        expected = lambda: c.metric("lockstep_routing_expected_hit_tokens_total", group=home)[0]
        agreed = lambda: c.metric("lockstep_routing_agreed_hit_tokens_total", group=home)[0]
        assert complete(c, hot + prompt(702, 8), 1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
        assert (expected(), agreed()) == (128, 128)
        for i in range(14):  # new prompts of 9 pages spread over both groups: more than the 40 pages of `home`
            complete(c, prompt(800 + i, 144), 1)
        assert sum(c.metric("lockstep_routing_decisions_total", group=home, reason="least_loaded")) >= 6
        body = complete(c, hot + prompt(703, 8), 1)
        assert c.metric("lockstep_routing_decisions_total", group=home, reason="prefix")[0] == 2
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached < 128 and (expected(), agreed()) == (256, 128 + cached)
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0
        c.assert_no_leak()
    finally:
        c.close()
