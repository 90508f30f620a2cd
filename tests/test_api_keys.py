"""API keys: `--api-key` / LOCKSTEP_API_KEY guard /v1/* and /admin/* (HTTP) and the gRPC inference API;
/health, /metrics, /openapi.json and /version stay open for probes, scrapers and discovery."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from lockstep.coordinator import auth
from lockstep.coordinator.auth import ApiKeys, parse_api_keys
from lockstep.coordinator.config import parse_config
from lockstep.coordinator.grpc_api import start_grpc
from lockstep.proto_gen.lockstep.v1 import inference_pb2 as ipb
from lockstep.proto_gen.lockstep.v1 import inference_pb2_grpc
from test_generation import FakeFrontend, tokens
from test_request_edge import ChatFrontend, _free_port

KEYS = ("key-one", "key-two")
GROUP = ["--group", "g0=127.0.0.1:1"]
BODIES = {"/v1/completions": {"prompt": [5, 6]}, "/v1/chat/completions": {"messages": [{"role": "user",
                                                                                        "content": "hi"}]}}


def test_keys_come_from_flags_else_from_the_comma_separated_variable():
    assert parse_api_keys([], "") == ()
    assert parse_api_keys([], " a , b,,a ") == ("a", "b")
    assert parse_api_keys(["x", "y"], "a,b") == ("x", "y")
    for bad in ("has space", "é", "a,b"):
        with pytest.raises(ValueError, match="printable ASCII") as info:
            parse_api_keys([bad])
        assert bad not in str(info.value)  # a key is never echoed


def test_coordinator_and_serve_read_api_keys():
    from lockstep.serve import parse_args

    config = parse_config([*GROUP, "--api-key", "k1", "--api-key", "k2"], {"LOCKSTEP_API_KEY": "env"})
    assert config.api_keys == ("k1", "k2") and "k1" not in repr(config)
    assert parse_config(GROUP, {"LOCKSTEP_API_KEY": "e1,e2"}).api_keys == ("e1", "e2")
    assert parse_config(GROUP, {}).api_keys == ()
    with pytest.raises(SystemExit):
        parse_config([*GROUP, "--api-key", "bad key"], {})
    assert parse_args(["--api-key", "s1"], {}).api_keys == ("s1",)
    assert parse_args([], {"LOCKSTEP_API_KEY": "s2,s3"}).api_keys == ("s2", "s3")


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    keys = ApiKeys(KEYS)
    assert keys.allows("Bearer key-one") and len(calls) == 2  # no early exit on the first match
    assert keys.allows("bearer  key-two ") and not keys.allows("Basic key-one") and not keys.allows("key-one")
    assert not keys.allows(None) and not keys.allows("Bearer ") and not keys.allows("Bearer key-one\u00e9")
    assert ApiKeys().allows(None) and not ApiKeys().enabled


def _calls(fe: FakeFrontend, keys: tuple[str, ...], calls: list[tuple[str, str, str | None]]) -> list:
    from aiohttp.test_utils import TestClient, TestServer

    from lockstep.coordinator.openai_api import OpenAIServer

    async def go():
        async with TestClient(TestServer(OpenAIServer(fe, keys).app())) as client:
            out = []
            for method, path, key in calls:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                body = BODIES.get(path, {}) if method == "POST" else None
                resp = await client.request(method, path, json=body, headers=headers)
                text = await resp.text()
                out.append((resp.status, resp.headers.get("WWW-Authenticate"), text))
            return out

    return asyncio.run(go())


def test_http_needs_a_key_on_v1_and_admin_and_nowhere_else():
    fe = ChatFrontend(tokens("Hello"))
    guarded = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
               ("GET", "/admin/steps"), ("POST", "/admin/reset_prefix_cache"), ("GET", "/nowhere")]
    refused = _calls(fe, KEYS, [(m, p, k) for m, p in guarded for k in (None, "wrong")])
    for status, challenge, text in refused:
        assert (status, challenge) == (401, "Bearer"), text
        assert '"type": "authentication_error"' in text and '"code": "invalid_api_key"' in text
    assert fe.asked == []
    allowed = _calls(fe, KEYS, [(m, p, k) for m, p in guarded[:-1] for k in KEYS])
    assert [s for s, _, _ in allowed] == [200] * 2 * (len(guarded) - 1), allowed
    assert _calls(fe, KEYS, [("GET", "/nowhere", "key-one")])[0][0] == 404
    open_paths = _calls(fe, KEYS, [("GET", p, None) for p in ("/health", "/metrics", "/openapi.json", "/version")])
    assert [s for s, _, _ in open_paths] == [200] * 4
    assert [s for s, _, _ in _calls(fe, (), [(m, p, None) for m, p in guarded[:-1]])] == [200] * 5


def test_grpc_needs_the_same_keys():
    fe = FakeFrontend(tokens("Hello"))

    async def go() -> list:
        port = _free_port()
        server = await start_grpc(fe, "127.0.0.1", port, KEYS)
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                req = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 6]))
                for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "Bearer key-two"),)):
                    for call in (stub.Complete(req, metadata=metadata), _drain(stub.Generate(req, metadata=metadata))):
                        try:
                            await call
                            out.append(grpc.StatusCode.OK)
                        except grpc.aio.AioRpcError as exc:
                            out.append(exc.code())
        finally:
            await server.stop(0)
        return out

    U = grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(go()) == [U, U, U, U, grpc.StatusCode.OK, grpc.StatusCode.OK]
    assert len(fe.asked) == 2


async def _drain(call) -> None:
    async for _ in call:
        pass
