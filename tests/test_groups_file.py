"""Groups come and go through the coordinator's groups file, with no restart and no request dropped.

The operator writes the group list into a ConfigMap that the kubelet swaps under the coordinator; here the
file is swapped the same way (a new file renamed over it) under a real coordinator process."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

from checkpoints import random_prompt as prompt
from cluster import Cluster, http

MAX_TOKENS = 480  # the tiny checkpoint's 512 positions, less the prompt: as long a stream as it allows


def stream(url: str, tokens: list[int]) -> tuple[int, list[int], str | None]:
    """A greedy streamed completion: (HTTP status, the token ids, the finish reason)."""
    body = {"prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    ids: list[int] = []
    reason = None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                chunk = json.loads(text[6:])
                assert "error" not in chunk, chunk
                ids.extend(chunk["choices"][0]["token_ids"])
                reason = chunk["choices"][0]["finish_reason"] or reason
        return resp.status, ids, reason


def groups_listed(c: Cluster) -> dict:
    return http("GET", c.url + "/health")[1]


def wait_for(check, timeout: float = 30.0):  # noqa: ANN001, ANN201 - a test helper
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {check.__name__}"
        time.sleep(0.2)
    return value


def test_a_group_removed_from_the_file_hands_its_streams_over_and_one_added_serves(tiny_llama, tmp_path):
    c = Cluster(tiny_llama, tp=1, kv_pages=256, log_dir=tmp_path, groups=2, groups_file=tmp_path / "groups",
                coordinator_args=["--routing", "least-loaded"])
    try:
        both_up = lambda: {n for n, g in groups_listed(c).items() if g["up"]} == {"g0", "g1"}  # noqa: E731
        wait_for(both_up)
        p = prompt(7, 20)
        status, undisturbed, _ = stream(c.url, p)
        assert status == 200 and len(undisturbed) == MAX_TOKENS
        pid = c.coordinator.pid

        c.groups_file.write_text("g0=\n")  # a broken file changes nothing, once the watch has read it
        wait_for(lambda: "is not valid" in c.log(c.coordinator))  # polled every GROUPS_POLL_S (2 s)
        assert set(groups_listed(c)) == {"g0", "g1"}

        streams: list[Future] = []
        with ThreadPoolExecutor(4) as pool:
            # streams on both groups all along, so g1 holds some when it goes
            while len(streams) < 4 or not all(sum(c.metric("lockstep_requests", group=g, state="running"))
                                                for g in ("g0", "g1")):
                streams.append(pool.submit(stream, c.url, p))
                time.sleep(0.2)
            c.write_groups([0])
            while "g1" in groups_listed(c):
                if sum(1 for f in streams if not f.done()) < 4:
                    streams.append(pool.submit(stream, c.url, p))
                time.sleep(0.1)
            results = [f.result(timeout=300) for f in streams]
        assert all(r == (200, undisturbed, "length") for r in results), [r[0] for r in results]
        log = c.log(c.coordinator)
        assert "moves from group g1 to g0" in log and "group g1 removed" in log, log[-3000:]
        assert c.coordinator.poll() is None and c.coordinator.pid == pid  # the same process: no restart
        assert set(groups_listed(c)) == {"g0"}
        assert 'group="g1"' not in c.metrics()
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0

        c.write_groups([0, 1])  # g1 back (its ranks never went): it serves again
        wait_for(both_up)
        assert http("POST", c.url + "/admin/drain?group=g0")[0] == 200
        status, body = c.complete({"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                   "return_token_ids": True})
        assert status == 200 and body["choices"][0]["token_ids"] == undisturbed[:8], body
        assert c.metric("lockstep_routing_decisions_total", group="g1", reason="least_loaded") == [1.0]
        assert http("POST", c.url + "/admin/resume?group=g0")[0] == 200
        assert sum(c.metric("lockstep_requests_dropped_total")) == 0 and c.coordinator.pid == pid
        c.assert_no_leak()
        c.assert_request_table_empty()
    finally:
        c.close()


def test_a_removed_groups_series_leave_metrics_and_the_others_stay():
    from lockstep.coordinator.metrics import Metrics, forget_group_series

    metrics = Metrics()
    for g in ("g0", "g1"):
        metrics.init_group(g, 2)
        metrics.ttft.labels(g).observe(0.1)
        metrics.requests_migrated.labels(g).inc()
    forget_group_series(metrics, "g1")
    text = metrics.render().decode()
    assert 'group="g1"' not in text
    assert 'lockstep_time_to_first_token_seconds_count{group="g0"} 1.0' in text
    assert 'lockstep_rank_up{group="g0",rank="1"}' in text
    metrics.init_group("g1", 1)  # a group added back at the same name starts from zero
    assert 'lockstep_requests_migrated_total{group="g1"} 0.0' in metrics.render().decode()


def test_apply_groups_starts_new_replaces_changed_and_removes_gone_groups_in_process():
    """Groups whose ranks are not there (down: nothing to move) are added, replaced and removed at once."""
    import asyncio

    from lockstep.coordinator.config import CoordinatorConfig
    from lockstep.coordinator.service import Coordinator

    nowhere = lambda port: (f"127.0.0.1:{port}",)  # noqa: E731 - nothing listens there: the groups stay down

    async def main() -> None:
        coord = Coordinator(CoordinatorConfig(groups={"g0": nowhere(9), "g1": nowhere(9)}), tokenizer=None,
                            model_name="m", max_model_len=64)
        coord.start()
        try:
            diff = await coord.apply_groups({"g1": nowhere(7), "g2": nowhere(9)})
            assert (diff.removed, set(diff.changed), set(diff.added)) == (("g0",), {"g1"}, {"g2"})
            assert coord.group_addresses == {"g1": nowhere(7), "g2": nowhere(9)}
            assert set(coord.health_detail()) == {"g1", "g2"} and 'group="g0"' not in coord.metrics_text().decode()
            assert not await coord.apply_groups({"g2": nowhere(9), "g1": nowhere(7)})  # the same list: no change
        finally:
            await coord.close()

    asyncio.run(main())
