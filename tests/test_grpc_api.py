"""The gRPC inference API at its edges, without ranks, over a real channel: a caller's request_id used again, and
requests that are not a GenerateRequest at all."""

from __future__ import annotations

import asyncio
import functools

import grpc

from lockstep import grpc_options
from lockstep.coordinator.generation import GenerateSpec, TokenEvent
from lockstep.coordinator.grpc_api import start_grpc
from lockstep.coordinator.request import FinishReason
from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc
from test_endings import _Endless, _grpc
from test_generation import FakeFrontend, tid, tokens
from test_request_edge import _free_port


def test_a_request_id_used_again_never_meets_the_request_it_named_before():
    """Found by a gRPC probe: a client that cancelled a stream (or hit its deadline) and at once sent the same
    request_id again reached the group while it still held the first request for a step (its release not planned
    yet, its chunk in the plan built ahead); that plan's reports met the new request under the old id and the
    group's step loop failed ("Request('same', running, ...) is at 0, its chunk started at 6"), failing every
    request the group ran. The coordinator now knows each call by an id of its own; the responses carry the
    caller's, and two calls at once with one id are still refused."""
    fe = FakeFrontend(tokens("Hello", " wor", reason=FinishReason.LENGTH))
    done, streamed = _grpc(fe, ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6]), request_id="mine"))
    (first, _), (second, _) = fe.asked
    assert first != second and first.startswith("mine") and second.startswith("mine")
    assert done.request_id == "mine" and {m.request_id for m in streamed} == {"mine"}
    _grpc(fe, ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6])))  # an id of the server's own: as it is
    assert all(rid.startswith("cmpl-") and len(rid) == 37 for rid, _ in fe.asked[2:])

    endless = _Endless([])

    async def go() -> tuple[grpc.StatusCode, str]:
        port = _free_port()
        server = await start_grpc(endless, "127.0.0.1", port)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                req = ipb.GenerateRequest(text="Hi", request_id="mine")
                stream = stub.Generate(req)
                await stream.read()
                try:
                    await stub.Complete(req)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                stream.cancel()
                while not endless.closed:
                    await asyncio.sleep(0.01)
                again = stub.Generate(req)
                msg = await again.read()  # the first call is over: its id is free again
                again.cancel()
                return code, msg.request_id
        finally:
            await server.stop(0)

    assert asyncio.run(go()) == (grpc.StatusCode.ALREADY_EXISTS, "mine")


def _statuses(fe: FakeFrontend, calls: list) -> list[tuple[grpc.StatusCode, str]]:
    """Each call (given a channel to a server for `fe`) made in turn: its status code and details."""

    async def go() -> list[tuple[grpc.StatusCode, str]]:
        port = _free_port()
        server = await start_grpc(fe, "127.0.0.1", port)
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for call in calls:
                    try:
                        await call(channel)
                        out.append((grpc.StatusCode.OK, ""))
                    except grpc.aio.AioRpcError as exc:
                        out.append((exc.code(), exc.details()))
            return out
        finally:
            await server.stop(0)

    return asyncio.run(go())


def test_bytes_that_are_not_a_generate_request_are_invalid_argument(caplog):
    """Found by a gRPC probe: a request whose string field is not UTF-8 (a C++ client sends one, warning only in its
    own log) or whose bytes are no protobuf at all was answered UNKNOWN ("Unexpected <class DecodeError>"), and the
    server logged a traceback at ERROR for each: a bad client filled the log and paged whoever watches its errors."""
    fe = FakeFrontend(tokens("Hello", reason=FinishReason.LENGTH))
    bad = [b"\x12\x02\xff\xfe", b"\x12\x02hi\x4a\x01\xff", b"\xff\xff"]  # text, a stop not UTF-8; no protobuf

    async def send(channel: grpc.aio.Channel, method: str, raw: bytes) -> None:
        if method == "Complete":
            await channel.unary_unary(f"/lockstep.v1.InferenceService/{method}")(raw)  # the bytes as they are
        else:
            _ = [m async for m in channel.unary_stream(f"/lockstep.v1.InferenceService/{method}")(raw)]

    got = _statuses(fe, [functools.partial(send, method=m, raw=raw) for m in ("Complete", "Generate") for raw in bad])
    assert [code for code, _ in got] == [grpc.StatusCode.INVALID_ARGUMENT] * 6, got
    assert all("not a valid GenerateRequest" in details for _, details in got) and not fe.asked
    assert not [r for r in caplog.records if r.levelno >= 40]


def test_a_long_name_a_status_quotes_is_cut_short_so_the_status_reaches_the_client():
    """Found by a gRPC probe: the status message quoted the request's whole `model` (and Health.Check its whole
    `service`); gRPC sends the message as a header, and one past 16 KB reached the client as RESOURCE_EXHAUSTED
    ("received metadata size exceeds hard limit"), not NOT_FOUND."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    fe = FakeFrontend(tokens("Hello", reason=FinishReason.LENGTH))

    calls = [lambda ch: inference_pb2_grpc.InferenceServiceStub(ch).Complete(
                 ipb.GenerateRequest(text="Hi", model="m" * 100_000)),
             lambda ch: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="s" * 100_000))]
    (model_code, model_says), (health_code, health_says) = _statuses(fe, calls)
    assert (model_code, health_code) == (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND)
    assert model_says.startswith("The model 'mmm") and "..." in model_says and len(model_says) < 400
    assert health_says.startswith("unknown service 'sss") and len(health_says) < 100


SLOW_TOKENS = 14


class _Slow(FakeFrontend):
    """A generation of seven seconds, one token every half second."""

    def generate(self, request_id: str, spec: GenerateSpec):
        self.asked.append((request_id, spec))
        return self._slow()

    async def _slow(self):
        for _ in range(SLOW_TOKENS):
            await asyncio.sleep(0.5)
            yield TokenEvent(tid(" wor"), None, 0)
        yield TokenEvent(None, FinishReason.LENGTH, 0)


def test_a_client_that_pings_as_often_as_the_server_allows_keeps_its_long_complete_call(monkeypatch):
    """Found by a gRPC probe: grpc's servers let a client ping once per 5 minutes while no data flows, and answer
    the third ping sooner with GOAWAY "too_many_pings"; a Complete call sends nothing until its generation ends, so
    a client with keepalive every 10-30 s (Go's and Java's shortest; set to outlive a load balancer's idle timeout)
    lost its call as UNAVAILABLE after a minute or two, its request aborted. Here the allowed interval is scaled
    down (MIN_CLIENT_PING_MS) and the client pings every second for a call of seven (GOAWAY after five before)."""
    monkeypatch.setattr(grpc_options, "MIN_CLIENT_PING_MS", 500, raising=False)
    fe = _Slow([])
    pinging = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 5000),
               ("grpc.http2.max_pings_without_data", 0)]

    async def go() -> ipb.GenerateResponse:
        port = _free_port()
        server = await start_grpc(fe, "127.0.0.1", port)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=pinging) as channel:
                return await inference_pb2_grpc.InferenceServiceStub(channel).Complete(ipb.GenerateRequest(text="Hi"))
        finally:
            await server.stop(0)

    done = asyncio.run(go())
    assert done.finish_reason == "length" and done.usage.completion_tokens == SLOW_TOKENS


def test_the_inference_port_binds_an_ipv6_host():
    """Found by a gRPC probe: `--host ::` (a dual-stack or IPv6-only cluster; the HTTP API and the ranks bind it)
    failed the coordinator's start: its gRPC address was ":::8001", which grpc reads as a host without a port."""
    import socket

    import pytest
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def go() -> int:
        port = _free_port()
        server = await start_grpc(FakeFrontend([]), "::", port)
        try:
            async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
                return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status
        finally:
            await server.stop(0)

    assert asyncio.run(go()) == health_pb2.HealthCheckResponse.SERVING
