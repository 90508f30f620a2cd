"""The inference port answers the standard gRPC discovery and probe services with a real grpc client:
server reflection (what grpcurl lists) and grpc.health.v1 (what a Kubernetes gRPC probe asks), SERVING
only while some group can serve, both open when API keys guard the inference calls."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lockstep.coordinator.grpc_api import start_grpc
from test_api_keys import KEYS
from test_generation import FakeFrontend, tokens
from test_request_edge import _free_port

H = health_pb2.HealthCheckResponse


class SwitchFrontend(FakeFrontend):
    """A frontend whose groups go down and up at the test's word."""

    up = True

    def healthy(self) -> bool:
        return self.up


async def _reflect(channel: grpc.aio.Channel) -> tuple[list[str], list[str]]:
    """The services reflection lists, and the methods of the inference service from its file descriptor."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="lockstep.v1.InferenceService")]
    answers = [a async for a in stub.ServerReflectionInfo(iter(requests))]
    services = [s.name for s in answers[0].list_services_response.service]
    methods = []
    for raw in answers[1].file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
        methods += [m.name for s in proto.service if s.name == "InferenceService" for m in s.method]
    return services, methods


def test_reflection_and_health_on_the_inference_port():
    fe = SwitchFrontend(tokens("Hello"))

    async def go() -> tuple:
        port = _free_port()
        server = await start_grpc(fe, "127.0.0.1", port, KEYS)  # keys guard inference, not discovery
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                services, methods = await _reflect(channel)
                health = health_pb2_grpc.HealthStub(channel)
                check = lambda name: health.Check(health_pb2.HealthCheckRequest(service=name))  # noqa: E731
                up = [(await check(n)).status for n in ("", "lockstep.v1.InferenceService")]
                fe.up = False
                down = (await check("")).status
                listed = await health.List(health_pb2.HealthListRequest())
                try:
                    await check("no.such.Service")
                    unknown = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    unknown = exc.code()
                watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
                first = await watch.read()
                fe.up = True
                second = await asyncio.wait_for(watch.read(), 10)
                watch.cancel()
        finally:
            await server.stop(0)
        return services, methods, up, down, listed, unknown, (first.status, second.status)

    services, methods, up, down, listed, unknown, watched = asyncio.run(go())
    assert "lockstep.v1.InferenceService" in services and "grpc.health.v1.Health" in services
    assert "grpc.reflection.v1alpha.ServerReflection" in services
    assert set(methods) >= {"Generate", "Complete"}
    assert up == [H.SERVING, H.SERVING] and down == H.NOT_SERVING
    assert {k: v.status for k, v in listed.statuses.items()} == {"": H.NOT_SERVING,
                                                                 "lockstep.v1.InferenceService": H.NOT_SERVING}
    assert unknown == grpc.StatusCode.NOT_FOUND
    assert watched == (H.NOT_SERVING, H.SERVING)
    assert fe.asked == []
