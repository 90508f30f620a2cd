"""API frontend processes (`--api-workers`): the link's messages, the HTTP API served over a real link (gRPC on
a unix socket) from a coordinator stand-in, and `lockstep serve --api-workers 2` end to end."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import tempfile
import time

import aiohttp
import psutil
import pytest

from cluster import http
from lockstep.coordinator import frontend_link
from lockstep.coordinator.frontend_link import start_link
from lockstep.coordinator.frontend_wire import (
    answer_of,
    error_of,
    events_from_proto,
    events_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.remote import RemoteCoordinator
from lockstep.coordinator.request import FinishReason
from lockstep.local_group import free_port
from lockstep.proto_gen.lockstep.v1 import frontend_pb2 as fpb
from lockstep.steps import SamplingParams, TokenLogprobs
from lockstep.wire import WireError
from test_generation import TOK, tid
from test_serve import _serving, _wait_healthy

WORD = tid("Hello")


def test_a_spec_crosses_the_link_whole():
    spec = GenerateSpec([5, 6, 7], SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-3, logprobs=2,
                                                  repetition_penalty=1.2, logit_bias={9: -3.0}, min_tokens=2,
                                                  stop_token_ids=(0,)),
                        40, ["\n\n", "END"], [0, 11], True, False, 1, True, True)
    msg = fpb.SubmitMsg.FromString(spec_to_proto("link", "r1", spec).SerializeToString())
    assert (msg.link_id, msg.request_id) == ("link", "r1")
    assert spec_from_proto(msg) == spec
    second = dataclasses.replace(spec, choice=1)  # choice 1 of a request of n: the coordinator counts only choice 0
    sent = spec_to_proto("link", "r1-1", second).SerializeToString()
    assert spec_from_proto(fpb.SubmitMsg.FromString(sent)) == second
    with pytest.raises(WireError, match="no request id"):
        spec_from_proto(spec_to_proto("link", "", spec))


def test_a_steps_events_cross_the_link_as_columns_with_extras_only_where_needed():
    lp = TokenLogprobs(-0.5, ((3, -0.5), (4, -1.5)))
    events = [("a", TokenEvent(7, None, 16)), ("b", TokenEvent(8, None, 0, logprobs=lp)),
              ("c", TokenEvent(None, FinishReason.LENGTH, 4)), ("d", TokenEvent(None, None, 0, "no group", 400)),
              ("e", TokenEvent(9, None, 0, prompt_logprobs=[TokenLogprobs(-1.0, ((9, -1.0),), 1),
                                                            TokenLogprobs(-2.0, (), 7)])),
              ("f", TokenEvent(10, None, 0, prompt_logprobs=[]))]
    msg = events_to_proto(events)
    assert sorted(x.index for x in msg.extras) == [1, 2, 3, 4, 5]  # a plain token is three column entries
    assert events_from_proto(fpb.StepEventsMsg.FromString(msg.SerializeToString())) == events


@pytest.mark.parametrize("broken, message", [
    (fpb.StepEventsMsg(request_ids=["a", "b"], token_ids=[1], cached_tokens=[0, 0]), "2 request ids, 1 tokens"),
    (fpb.StepEventsMsg(request_ids=["a"], token_ids=[1], cached_tokens=[0], extras=[fpb.EventExtrasMsg(index=1)]),
     "extras for event 1 of 1"),
    (fpb.StepEventsMsg(request_ids=["a"], token_ids=[1], cached_tokens=[0],
                       extras=[fpb.EventExtrasMsg(index=0, finish_reason="bored")]), "unknown finish reason"),
])
def test_a_malformed_step_message_is_a_wire_error(broken, message):
    with pytest.raises(WireError, match=message):
        events_from_proto(broken)


def test_a_refusal_crosses_the_link_as_the_same_api_error():
    err = error_of(fpb.SubmitAnswer.FromString(answer_of(ApiError(
        503, "overloaded", None, "server_overloaded", "service_unavailable", 2.5)).SerializeToString()))
    assert (err.status, err.message, err.param, err.code, err.err_type) == (
        503, "overloaded", None, "server_overloaded", "service_unavailable")
    assert err.headers() == {"Retry-After": "3"} and answer_of(None).ok
    assert error_of(answer_of(ApiError(400, "no", "max_tokens"))).headers() == {}


class TickingCoordinator:
    """The coordinator's side of the link, without groups: every live request gets one token per tick."""

    model_name, max_model_len, max_logprobs = "tiny", 1 << 16, 5

    def __init__(self) -> None:
        self.live: dict[str, list] = {}
        self.ended: list[tuple[str, bool]] = []
        self.stopped: list[str] = []  # ended by their frontend at a stop string
        self.refuse: ApiError | None = None
        self.up = True
        self.ticks = 0
        self.metrics = Metrics()

    def submit(self, request_id: str, spec: GenerateSpec, queue) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.live[request_id] = [queue, spec.max_tokens, 0]

    def _end(self, request_id: str, finished: bool, stopped: bool = False) -> None:
        self.ended.append((request_id, finished))
        self.stopped += [request_id] if stopped else []
        self.live.pop(request_id, None)

    def tick(self) -> None:
        self.ticks += 1
        for state in list(self.live.values()):
            state[2] += 1
            state[0].put(TokenEvent(WORD, FinishReason.LENGTH if state[2] >= state[1] else None))

    def healthy(self) -> bool:
        return self.up

    def health_detail(self) -> dict:
        return {"g0": {"up": self.up}}

    def metrics_text(self) -> bytes:
        return b"lockstep_up 1\n"

    async def reset_prefix_cache(self, rank: int | None) -> None:
        if rank == 7:
            raise ApiError(503, "group g0 is down", code="group_unavailable", err_type="service_unavailable")
        if rank is not None and rank > 1:
            raise ValueError(f"rank {rank} is not in the group")

    def step_log(self, group: str | None, since: int) -> dict:
        if group not in (None, "g0"):
            raise KeyError(group)
        return {"group": "g0", "steps": [], "next": since}

    def resume(self, group: str) -> dict:
        return self.step_log(group, 0)

    async def drain(self, group: str, migrate: bool = False) -> dict:
        return self.step_log(group, 0)


@contextlib.asynccontextmanager
async def _linked(tmp_path, coordinator: TickingCoordinator):
    """The link server around `coordinator`, one frontend (RemoteCoordinator) with its HTTP app, a ticker."""
    address = f"unix:{tmp_path}/link.sock"
    server, servicer = await start_link(coordinator, address)
    remote = RemoteCoordinator(address, TOK)
    await remote.connect(10)
    pump = asyncio.ensure_future(remote.pump())
    port = free_port()
    runner = await run_app(OpenAIServer(remote).app(), "127.0.0.1", port, 1.0)

    async def ticking() -> None:
        while True:
            await asyncio.sleep(0.005)
            coordinator.tick()

    ticker = asyncio.ensure_future(ticking())
    try:
        async with aiohttp.ClientSession() as session:
            yield servicer, remote, pump, session, f"http://127.0.0.1:{port}", server
    finally:
        ticker.cancel()
        await runner.cleanup()
        pump.cancel()
        await remote.close()
        await server.stop(0)


async def _eventually(check, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def _stream_body(max_tokens: int) -> dict:
    return {"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True}


async def _chunks(resp: aiohttp.ClientResponse) -> list[dict | str]:
    out: list[dict | str] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            text = line[6:].strip().decode()
            out.append(text if text == "[DONE]" else json.loads(text))
    return out


def test_every_token_comes_through_a_frontend_and_a_step_is_one_message(tmp_path, monkeypatch):
    """8 streams at once: every token arrives in order, each request ends once (as finished) on the coordinator,
    and the link sends one message per tick with every live request's token in it."""
    sizes: list[int] = []
    real = frontend_link.events_to_proto
    monkeypatch.setattr(frontend_link, "events_to_proto", lambda events: (sizes.append(len(events)), real(events))[1])
    coord = TickingCoordinator()

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, _, session, url, _):
            async def one() -> list:
                async with session.post(url + "/v1/completions", json=_stream_body(6)) as resp:
                    assert resp.status == 200
                    return await _chunks(resp)

            got = await asyncio.gather(*(one() for _ in range(8)))
            for chunks in got:
                assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello" * 6
                assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1] == "[DONE]"
            await _eventually(lambda: len(coord.ended) == 8)
            assert all(finished for _, finished in coord.ended) and not remote.boxes
            assert not next(iter(servicer.links.values())).requests

    asyncio.run(main())
    assert max(sizes) == 8 and len(sizes) <= coord.ticks  # a tick's tokens of all 8 streams: one message


def test_a_refusal_is_an_http_status_before_any_stream(tmp_path):
    coord = TickingCoordinator()
    coord.refuse = ApiError(503, "the server is overloaded", code="server_overloaded", err_type="service_unavailable")

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, _, session, url, _):
            async with session.post(url + "/v1/completions", json=_stream_body(4)) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "5"
                assert (await resp.json())["error"]["code"] == "server_overloaded"
            assert not remote.boxes and not next(iter(servicer.links.values())).requests

    asyncio.run(main())


def test_a_client_gone_mid_stream_aborts_its_request_on_the_coordinator(tmp_path):
    coord = TickingCoordinator()

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, _, session, url, _):
            async with session.post(url + "/v1/completions", json=_stream_body(10_000)) as resp:
                await resp.content.readline()
                resp.close()  # hang up
            await _eventually(lambda: len(coord.ended) == 1)
            assert coord.ended[0][1] is False and not coord.live and not remote.boxes
            assert not next(iter(servicer.links.values())).requests

    asyncio.run(main())


def test_a_request_its_frontend_ends_at_a_stop_string_is_aborted_as_a_finished_one(tmp_path):
    """The frontend finds the stop string; its Cancel says so, so that the coordinator counts the request as finished
    (duration, prompt tokens) while it aborts it. A client gone says nothing of the kind."""
    coord = TickingCoordinator()

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, _, session, url, _):
            status, body = await _post_json(session, url, {"prompt": [1, 2], "max_tokens": 50, "stop": ["HelloHello"]})
            assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
            await _eventually(lambda: len(coord.ended) == 1)
            assert coord.ended[0][1] is False and coord.stopped == [coord.ended[0][0]]
            async with session.post(url + "/v1/completions", json=_stream_body(10_000)) as resp:
                await resp.content.readline()
                resp.close()  # hang up
            await _eventually(lambda: len(coord.ended) == 2)
            assert len(coord.stopped) == 1

    asyncio.run(main())


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


def test_a_request_cancelled_while_it_is_submitted_is_aborted_once_it_is_queued(tmp_path, monkeypatch):
    """The frontend's handler is cancelled (its server stops) while the coordinator still queues the request:
    the request must not run on with nobody to read it."""
    coord = TickingCoordinator()
    submit = frontend_link.FrontendLinkServicer.Submit

    async def slow_submit(self, request, context):
        await asyncio.sleep(0.3)
        return await submit(self, request, context)

    monkeypatch.setattr(frontend_link.FrontendLinkServicer, "Submit", slow_submit)

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, _, _, _, _):
            task = asyncio.ensure_future(remote.generate("r1", GenerateSpec([1, 2], SamplingParams(), 10_000)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _eventually(lambda: coord.ended == [("r1", False)])
            assert not coord.live and not remote.boxes and not next(iter(servicer.links.values())).requests

    asyncio.run(main())


def test_a_frontend_gone_aborts_every_request_it_holds(tmp_path):
    coord = TickingCoordinator()

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, _, session, url, _):
            streams = [asyncio.ensure_future(session.post(url + "/v1/completions", json=_stream_body(10_000)))
                       for _ in range(3)]
            await _eventually(lambda: len(coord.live) == 3)
            await remote.channel.close()  # the frontend process's end of the link, as when it dies
            await _eventually(lambda: len(coord.ended) == 3 and not servicer.links)
            assert not any(finished for _, finished in coord.ended) and not coord.live
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    asyncio.run(main())


def test_a_coordinator_gone_ends_the_open_streams_with_an_error_event(tmp_path):
    coord = TickingCoordinator()

    async def main() -> None:
        async with _linked(tmp_path, coord) as (_, remote, pump, session, url, server):
            async with session.post(url + "/v1/completions", json=_stream_body(10_000)) as resp:
                await resp.content.readline()
                await server.stop(0)
                chunks = await asyncio.wait_for(_chunks(resp), 10)
            assert "the coordinator closed" in chunks[-2]["error"]["message"] and chunks[-1] == "[DONE]"
            await asyncio.wait_for(pump, 5)
            assert not remote.boxes
            async with session.get(url + "/health") as resp:  # not a 503 whose body reads as the groups' state
                assert resp.status == 502 and "the coordinator closed" in (await resp.json())["error"]["message"]
            async with session.get(url + "/metrics") as resp:
                assert resp.status == 503
            async with session.post(url + "/admin/resume?group=g0") as resp:
                assert resp.status == 503

    asyncio.run(main())


def test_a_message_the_frontend_cannot_read_ends_its_streams_instead_of_leaving_them_waiting(tmp_path,
                                                                                              monkeypatch):
    from lockstep.coordinator import remote as remote_module

    coord = TickingCoordinator()
    seen = []

    def unreadable(msg):
        seen.append(msg)
        if len(seen) > 3:
            raise WireError("step events: extras for event 9 of 1")
        return events_from_proto(msg)

    monkeypatch.setattr(remote_module, "events_from_proto", unreadable)

    async def main() -> None:
        async with _linked(tmp_path, coord) as (_, remote, pump, session, url, _):
            async with session.post(url + "/v1/completions", json=_stream_body(10_000)) as resp:
                chunks = await asyncio.wait_for(_chunks(resp), 10)
            assert "the coordinator closed" in chunks[-2]["error"]["message"] and chunks[-1] == "[DONE]"
            await asyncio.wait_for(pump, 5)

    asyncio.run(main())


def test_a_steps_events_are_split_only_where_prompt_logprobs_make_them_large():
    from lockstep.coordinator.frontend_wire import split_events

    plain = [(f"r{i}", TokenEvent(5)) for i in range(256)]
    assert split_events(plain, 1 << 20) == [plain]
    big = [TokenLogprobs(-1.0, tuple((t, -1.0) for t in range(20)))] * 5000  # ~1.3 MB of prompt logprobs
    events = [("a", TokenEvent(5)), ("b", TokenEvent(5, prompt_logprobs=big)), ("c", TokenEvent(5)),
              ("d", TokenEvent(5))]
    runs = split_events(events, 1 << 20)  # b alone is over the budget: a message of its own
    assert [[rid for rid, _ in run] for run in runs] == [["a"], ["b"], ["c", "d"]]
    assert [pair for run in runs for pair in run] == events


def test_health_metrics_and_admin_answers_come_from_the_coordinator(tmp_path):
    coord = TickingCoordinator()

    async def main() -> None:
        async with _linked(tmp_path, coord) as (_, _, _, session, url, _):
            async with session.get(url + "/health") as resp:
                assert resp.status == 200 and await resp.json() == {"g0": {"up": True}}
            coord.up = False
            async with session.get(url + "/health") as resp:
                assert resp.status == 503 and await resp.json() == {"g0": {"up": False}}
            async with session.get(url + "/metrics") as resp:
                assert await resp.text() == "lockstep_up 1\n"
            async with session.get(url + "/admin/steps?group=g9") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "group_not_found"
            async with session.get(url + "/admin/steps?group=g0&since=3") as resp:
                assert await resp.json() == {"group": "g0", "steps": [], "next": 3}
            async with session.post(url + "/admin/reset_prefix_cache?rank=5") as resp:
                assert resp.status == 400 and "rank 5 is not in the group" in (await resp.json())["error"]["message"]
            async with session.post(url + "/admin/reset_prefix_cache?rank=1") as resp:
                assert resp.status == 200
            async with session.post(url + "/admin/reset_prefix_cache?rank=7") as resp:  # as in process: not a 500
                assert resp.status == 503 and resp.headers["Retry-After"] == "5"
                assert (await resp.json())["error"]["code"] == "group_unavailable"
            async with session.post(url + "/admin/resume?group=g1") as resp:
                assert resp.status == 404
            async with session.get(url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "tiny"

    asyncio.run(main())


def test_api_workers_fail_their_start_on_a_port_in_use_or_a_frontend_that_cannot_start(tmp_path, monkeypatch):
    """A failed start leaves nothing behind: no link directory, and no link server still serving (it was left
    running, to be collected after its event loop closed)."""
    import glob
    import socket
    from dataclasses import replace

    from lockstep.coordinator import api_workers
    from lockstep.coordinator.api_workers import ApiWorkers
    from lockstep.coordinator.config import CoordinatorConfig

    links = set(glob.glob(f"{tempfile.gettempdir()}/lockstep-link-*"))
    servers = []

    async def recorded(*args):
        server, servicer = await start_link(*args)
        servers.append(server)
        return server, servicer

    monkeypatch.setattr(api_workers, "start_link", recorded)

    async def main() -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            cfg = CoordinatorConfig(groups={"g0": ("127.0.0.1:1",)}, host="127.0.0.1",
                                    http_port=busy.getsockname()[1], api_workers=1)
            with pytest.raises(OSError):
                await ApiWorkers.start(TickingCoordinator(), cfg, tmp_path)
        with pytest.raises(RuntimeError, match="exited with 1 before it linked"):
            await ApiWorkers.start(TickingCoordinator(), replace(cfg, http_port=free_port()), tmp_path / "none")
        assert len(servers) == 1 and not await servers[0].wait_for_termination(1.0)  # True: it timed out

    asyncio.run(main())
    assert set(glob.glob(f"{tempfile.gettempdir()}/lockstep-link-*")) == links


def test_serve_with_api_workers_answers_as_the_coordinator_does_and_restarts_a_frontend_that_dies(
        tiny_llama, tmp_path):
    """Two frontend processes share the HTTP port: greedy answers through them equal the coordinator's own gRPC
    API's (served in its process); a frontend killed mid-stream has its request aborted (its pages freed) and is
    started again; SIGINT stops every process."""
    import grpc

    from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
    from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc

    with _serving(tmp_path, "--model", str(tiny_llama), "--kv-pages", "64", "--threads", "1", "--tp", "1",
                  "--api-workers", "2") as (proc, port, log):
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, port, log)

        def frontends() -> list[psutil.Process]:
            return _frontends(proc.pid)

        assert len(frontends()) == 2
        prompt = list(range(5, 25))
        with grpc.insecure_channel(f"127.0.0.1:{port + 1}") as channel:
            want = inference_pb2_grpc.InferenceServiceStub(channel).Complete(
                ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=prompt), max_tokens=12, temperature=0,
                                    ignore_eos=True, return_token_ids=True), timeout=60)
        assert len(want.token_ids) == 12
        for _ in range(4):  # connections spread over both frontends; each answers alike
            status, body = http("POST", url + "/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert status == 200 and body["choices"][0]["token_ids"] == list(want.token_ids), body
        stream = subprocess.Popen(["curl", "-sN", url + "/v1/completions", "-H", "content-type: application/json",
                                   "-d", json.dumps({**_stream_body(400), "ignore_eos": True})],
                                  stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while 'lockstep_requests{group="g0",state="running"} 1.0' not in http("GET", url + "/metrics")[1]:
                assert time.monotonic() < deadline, "the stream never ran"
                time.sleep(0.05)
            # the one holding the stream, whichever the kernel gave the connection
            (victim,) = [p for p in frontends() if any(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                                                       for c in p.net_connections())]
            victim.kill()
            deadline = time.monotonic() + 60
            while not (len(frontends()) == 2 and victim not in frontends()
                       and 'lockstep_requests{group="g0",state="running"} 0.0' in http("GET", url + "/metrics")[1]
                       and re.search(r"API frontend [01] \(pid \d+\) exited", log.read_text())):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        finally:
            stream.kill()
        text = log.read_text()
        assert "unlinked: 1 request(s) of it aborted" in text  # the abort freed it, not the stream's end
        everyone = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 130)
        _, alive = psutil.wait_procs(everyone, timeout=15)
        assert not alive, "processes outlived lockstep serve"


def _frontends(pid: int) -> list[psutil.Process]:
    """The API frontend processes under `lockstep serve`'s process `pid`."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one killed a moment ago: gone, or not reaped yet
            if "lockstep.coordinator.remote" in " ".join(p.cmdline()):
                found.append(p)
    return found


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_frontend_whose_loop_is_stopped_is_killed_and_started_again_so_no_connection_hangs_on_it(
        tiny_llama, tmp_path):
    """A frontend stopped (SIGSTOP; or its event loop wedged) still holds its share of the shared port: the kernel
    hands it connections that nobody answers. Its heartbeats stop, so the coordinator kills it within
    FRONTEND_SILENT_S and starts another; after that every request is answered."""
    from lockstep.coordinator.api_workers import FRONTEND_SILENT_S

    with _serving(tmp_path, "--model", str(tiny_llama), "--kv-pages", "64", "--threads", "1", "--tp", "1",
                  "--api-workers", "2") as (proc, port, log):
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, port, log)
        victim = _frontends(proc.pid)[0]
        victim.suspend()
        deadline = time.monotonic() + FRONTEND_SILENT_S + 30
        while not _gone(victim) or len(_frontends(proc.pid)) < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert f"API frontend pid {victim.pid} sent no heartbeat" in log.read_text()
        for _ in range(8):  # each connection to a frontend that answers
            status, body = http("POST", url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}, timeout=20)
            assert status == 200, body


class HeavyTickingCoordinator(TickingCoordinator):
    """Every token with logprobs of 20 alternatives, as a request asking for them gets."""

    def tick(self) -> None:
        self.ticks += 1
        heavy = TokenLogprobs(-0.5, tuple((i, -1.0 - i) for i in range(20)))
        for state in list(self.live.values()):
            state[2] += 1
            state[0].put(TokenEvent(WORD, FinishReason.LENGTH if state[2] >= state[1] else None, logprobs=heavy))


def test_a_frontend_that_stops_reading_its_link_has_its_requests_aborted_and_takes_no_more(tmp_path, monkeypatch):
    """A frontend alive but wedged (its link open, nothing read): once gRPC's buffers are full and nothing has been
    taken for LINK_STALL_S, its requests are aborted (their pages freed) and the link queues nothing more, instead
    of the coordinator holding every event for it and generating on; a new request through it is a 503. When it
    reads again it gets what was queued, then its link ends with the reason (the frontend exits and is started
    again), and its open streams end with an error."""
    monkeypatch.setattr(frontend_link, "LINK_STALL_S", 0.3)
    coord = HeavyTickingCoordinator()  # a few KB a step: gRPC's buffers fill in seconds
    streams = 16

    async def main() -> None:
        async with _linked(tmp_path, coord) as (servicer, remote, pump, session, url, _):
            posts = [asyncio.ensure_future(session.post(url + "/v1/completions", json=_stream_body(50_000)))
                     for _ in range(streams)]
            await _eventually(lambda: len(coord.live) == streams, within_s=30)
            reading = asyncio.Event()
            read = remote._events.read

            async def wedged_read():
                await reading.wait()
                return await read()

            link = next(iter(servicer.links.values()))
            told = []
            link.on_wedged = lambda wedged: told.append(wedged.link_id)  # ApiWorkers kills it; here: recorded
            remote._events.read = wedged_read  # the frontend's pump takes nothing more off its link
            await _eventually(lambda: len(coord.ended) == streams, within_s=60)
            assert not coord.live and not any(finished for _, finished in coord.ended)
            assert link.wedged and not link.requests and told == [link.link_id] and link.pid == os.getpid()
            assert link.out.qsize() == 1 and link.backlog == 0  # what waited for it is dropped: only its end
            queued, ticks = link.out.qsize(), coord.ticks
            await _eventually(lambda: coord.ticks > ticks + 20)
            assert link.out.qsize() == queued  # nothing more is held for it
            late = spec_to_proto(link.link_id, "late", GenerateSpec([1, 2], SamplingParams(), 3))
            answer = await servicer.Submit(late, None)
            assert error_of(answer).status == 503 and error_of(answer).code == "frontend_unlinked"
            assert coord.metrics.requests_rejected.labels("frontend_unlinked")._value.get() == 1  # counted
            reading.set()  # it reads again: what was queued, then the link's end
            await asyncio.wait_for(pump, 30)
            assert not servicer.links and not remote.boxes
            for p in posts:
                p.cancel()
            await asyncio.gather(*posts, return_exceptions=True)

    asyncio.run(main())


def test_one_large_step_never_wedges_a_link_but_a_backlog_left_waiting_does(monkeypatch):
    """The byte cap counts what earlier steps left waiting, so one step's events (prompt logprobs come whole, up to
    the link's largest message) never trip it on their own; bytes the stream leaves waiting past it do."""
    monkeypatch.setattr(frontend_link, "LINK_BACKLOG_BYTES", 1500)
    heavy = TokenEvent(WORD, logprobs=TokenLogprobs(-0.5, tuple((i, -1.0 - i) for i in range(200))))

    async def main() -> None:
        coord = TickingCoordinator()
        link = frontend_link.Link(coord, "l1")
        link.submit("r1", GenerateSpec([1, 2], SamplingParams(), 10))
        link.add("r1", heavy)
        await asyncio.sleep(0)
        assert link.backlog > 1500 and not link.wedged  # one step, more than the cap: delivered, not a wedge
        link.add("r1", heavy)
        await asyncio.sleep(0)
        assert link.wedged and coord.ended == [("r1", False)] and link.out.qsize() == 1

    asyncio.run(main())


def test_a_wedged_frontend_is_killed_so_that_it_is_started_again():
    """ApiWorkers.kill_wedged: the process the link names, and only one of its own, is killed (the watch then
    starts it again); a link that named no process, or another, kills nothing."""
    import sys
    from types import SimpleNamespace

    from lockstep.coordinator.api_workers import ApiWorkers

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        workers = ApiWorkers(None, None, None, "", None, None)
        workers.procs = procs
        workers.kill_wedged(SimpleNamespace(pid=0))
        workers.kill_wedged(SimpleNamespace(pid=os.getpid()))
        assert all(p.poll() is None for p in procs)
        workers.kill_wedged(SimpleNamespace(pid=procs[1].pid))
        assert procs[1].wait(10) == -signal.SIGKILL and procs[0].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_frontend_is_killed_once_its_heartbeats_stop_and_a_starting_one_has_its_start_timeout():
    """ApiWorkers.kill_silent: heard within FRONTEND_SILENT_S, or started within START_TIMEOUT_S and not heard yet,
    it lives; past either it is killed. A beat older than the process's start (its pid once another's) counts as
    none."""
    import sys
    from types import SimpleNamespace

    from lockstep.coordinator.api_workers import FRONTEND_SILENT_S, START_TIMEOUT_S, ApiWorkers

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        workers = ApiWorkers(None, None, None, "", None, SimpleNamespace(beats={}))
        workers.procs, now = procs, 1000.0
        workers.started = [now - 1, now - START_TIMEOUT_S - 1, now - 100, now - 100]
        workers.servicer.beats = {procs[1].pid: now - 200, procs[2].pid: now - FRONTEND_SILENT_S + 1,
                                  procs[3].pid: now - FRONTEND_SILENT_S - 1}
        workers.kill_silent(now)
        assert procs[1].wait(10) == procs[3].wait(10) == -signal.SIGKILL
        assert procs[0].poll() is None and procs[2].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_frontends_get_the_api_keys_but_not_the_ranks_group_token():
    """A frontend talks only to its coordinator: the ranks' token (found by a helper in its environment) stays
    with the coordinator."""
    from lockstep.coordinator.api_workers import frontend_env

    parent = {"PATH": "/bin", "LOCKSTEP_GROUP_TOKEN": "s3cret", "LOCKSTEP_GROUP_TOKEN_FILE": "/run/token"}
    env = frontend_env(parent, ["k1", "k2"])
    assert env == {"PATH": "/bin", "LOCKSTEP_API_KEY": "k1,k2"}
    assert parent["LOCKSTEP_GROUP_TOKEN"] == "s3cret"  # the coordinator's own is untouched
