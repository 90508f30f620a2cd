"""The gRPC inference service: the same validation and token stream as the HTTP API, over protobuf.

The request's proto fields become the same typed `SamplingFields` the HTTP API fills from JSON, and
generation.py validates them; nothing here knows about the HTTP API.
"""

from __future__ import annotations

import asyncio
import reprlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import replace
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lockstep.coordinator.auth import ApiKeys
from lockstep.coordinator.endings import StopReason
from lockstep.coordinator.generation import (
    ApiError,
    Frontend,
    GenerateSpec,
    SamplingFields,
    build_spec,
    check_model,
    collect,
    generate_text,
)
from lockstep.coordinator.openai_fields import max_logprobs_of
from lockstep.coordinator.prompt_encoding import encode_prompt
from lockstep.grpc_options import add_port, host_port, server_options
from lockstep.proto_gen.lockstep.v1 import inference_pb2, inference_pb2_grpc
from lockstep.steps import TokenLogprobs

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
           503: grpc.StatusCode.UNAVAILABLE}
_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty", "frequency_penalty",
             "presence_penalty", "min_tokens", "ignore_eos")
MAX_REQUEST_ID_CHARS = 256
INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
_SERVICE = f"/{INFERENCE_SERVICE}/"
HEALTH_WATCH_POLL_S = 1.0  # how soon a Watch hears that the last group went down (or one came up)


def sampling_fields(req: inference_pb2.GenerateRequest) -> SamplingFields:
    """The request's sampling fields; an optional field left unset is None (the default), as in JSON."""
    given = {name: getattr(req, name) for name in _OPTIONAL if req.HasField(name)}
    return SamplingFields(stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
                          logit_bias=dict(req.logit_bias) or None, **given)


class Undecodable(NamedTuple):
    """Bytes that are not a GenerateRequest, and why (a C++ client sends a string field that is not UTF-8, warning
    only in its own log): the call answers INVALID_ARGUMENT. With grpc's own decoding it answered UNKNOWN, and
    the server logged a traceback at ERROR for each such call."""

    error: str


def decode_request(data: bytes) -> inference_pb2.GenerateRequest | Undecodable:
    try:
        return inference_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return Undecodable(str(exc))


async def request_spec(frontend: Frontend, req: inference_pb2.GenerateRequest | Undecodable
                       ) -> tuple[GenerateSpec, str]:
    """The validated spec of a request and its id (the caller's, or a new one)."""
    if isinstance(req, Undecodable):
        raise ApiError(400, f"the request is not a valid GenerateRequest: {req.error}")
    check_model(frontend, req.model or None)
    which = req.WhichOneof("prompt")
    if which == "text":
        prompt_ids = await encode_prompt(frontend.tokenizer, req.text)
    elif which == "token_ids":
        prompt_ids = list(req.token_ids.ids)
    else:
        raise ApiError(400, "the request has no prompt (text or token_ids)")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise ApiError(400, f"'request_id' must have at most {MAX_REQUEST_ID_CHARS} characters", "request_id")
    spec = build_spec(frontend, sampling_fields(req), prompt_ids)
    asked = {name: _logprobs_field(frontend, req, name) for name in ("logprobs", "prompt_logprobs")}
    spec = replace(spec, sampling=replace(spec.sampling, **{k: v for k, v in asked.items() if v >= 0}))
    return spec, req.request_id or ("cmpl-" + uuid.uuid4().hex)


def _logprobs_field(frontend: Frontend, req: inference_pb2.GenerateRequest, name: str) -> int:
    """The request's `logprobs` or `prompt_logprobs` (-1: unset), within the coordinator's --max-logprobs."""
    if not req.HasField(name):
        return -1
    k, most = getattr(req, name), max_logprobs_of(frontend)
    if not 0 <= k <= most:
        raise ApiError(400, f"'{name}' must be between 0 and {most}, got {k} (the server's --max-logprobs)", name)
    return k


def _stop_reason(msg: inference_pb2.GenerateResponse, why: StopReason) -> None:
    """vLLM's stop_reason into the message's oneof (a stop string, or a stop token id)."""
    if isinstance(why, str):
        msg.stop_string = why
    elif why is not None:
        msg.stop_token_id = why


def logprob_msgs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None]
                 ) -> list[inference_pb2.TokenLogprobs]:
    """The tokens' logprobs as messages (a token the ranks sent none for has no message)."""
    return [inference_pb2.TokenLogprobs(token_id=t, logprob=lp.logprob, top_ids=[i for i, _ in lp.top],
                                        top_logprobs=[v for _, v in lp.top], rank=lp.rank)
            for t, lp in zip(token_ids, logprobs, strict=False) if lp is not None]


def prompt_logprob_msgs(spec: GenerateSpec, prompt_logprobs: Sequence[TokenLogprobs] | None
                        ) -> list[inference_pb2.TokenLogprobs]:
    """The prompt's logprobs as messages, entry i prompt token i + 1's (with its rank), each top cut to the k
    asked for, so the answer holds what the request asked whatever the ranks sent."""
    k = spec.sampling.prompt_logprobs
    if k < 0 or prompt_logprobs is None:
        return []
    cut = [replace(lp, top=lp.top[:k]) for lp in prompt_logprobs]
    return logprob_msgs(spec.prompt_ids[1:], cut)


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Generate (a stream of text pieces) and Complete (one answer) over the coordinator."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self._callers_ids: set[str] = set()  # the request_ids callers gave the calls now in progress

    @contextmanager
    def _call_id(self, rid: str, given: bool) -> Iterator[str]:
        """The id the coordinator knows a call by. A caller's `request_id` gets a suffix of its own (as vLLM's
        engine makes external ids unique): a client that cancels a call or hits its deadline and sends the same
        id at once reached the group while it still held the first request for a step (its release not planned
        yet, its chunk in the plan built ahead), and that plan's reports, meeting the new request under the old id,
        failed the group's step loop and every request in it. Two calls at once with one id are still refused."""
        if not given:
            yield rid
            return
        if rid in self._callers_ids:
            raise ApiError(409, f"request id {rid!r} is already running", "request_id", "request_id_in_use")
        self._callers_ids.add(rid)
        try:
            yield f"{rid}-{uuid.uuid4().hex[:8]}"
        finally:
            self._callers_ids.discard(rid)

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """One message per text piece; the last one carries the finish reason and the usage."""
        try:
            spec, rid = await request_spec(self.frontend, request)
            first, generated = True, 0
            with self._call_id(rid, bool(request.request_id)) as call_id:
                async with aclosing(generate_text(self.frontend, call_id, spec)) as pieces:
                    async for piece in pieces:
                        msg = inference_pb2.GenerateResponse(request_id=rid, text=piece.text,
                                                             finish_reason=piece.finish_reason or "")
                        generated += len(piece.token_ids)
                        if request.return_token_ids:
                            msg.token_ids.extend(piece.token_ids)
                            if first:
                                msg.prompt_token_ids.extend(spec.prompt_ids)
                        msg.logprobs.extend(logprob_msgs(piece.token_ids, piece.logprobs))
                        msg.prompt_logprobs.extend(prompt_logprob_msgs(spec, piece.prompt_logprobs))  # the first's
                        _stop_reason(msg, piece.stop_reason)
                        if piece.finish_reason is not None:
                            msg.usage.CopyFrom(_usage(len(spec.prompt_ids), generated, piece.cached_tokens))
                        first = False
                        yield msg
        except ApiError as exc:
            await _abort(context, exc)

    async def Complete(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> inference_pb2.GenerateResponse:
        """The whole answer, with its usage."""
        try:
            spec, rid = await request_spec(self.frontend, request)
            with self._call_id(rid, bool(request.request_id)) as call_id:
                done = await collect(generate_text(self.frontend, call_id, spec))
        except ApiError as exc:
            await _abort(context, exc)
        usage = _usage(len(spec.prompt_ids), len(done.token_ids), done.cached_tokens)
        msg = inference_pb2.GenerateResponse(request_id=rid, text=done.text, finish_reason=done.finish_reason or "",
                                             usage=usage, logprobs=logprob_msgs(done.token_ids, done.logprobs),
                                             prompt_logprobs=prompt_logprob_msgs(spec, done.prompt_logprobs))
        _stop_reason(msg, done.stop_reason)
        if request.return_token_ids:
            msg.token_ids.extend(done.token_ids)
            msg.prompt_token_ids.extend(spec.prompt_ids)
        return msg


async def _abort(context: grpc.aio.ServicerContext, exc: ApiError) -> None:
    """End the call with the error's status; one the client may retry (overload, no group up) says when in
    `grpc-retry-pushback-ms`, gRPC's own retry hint (HTTP's Retry-After)."""
    pushback = () if exc.retry_after is None else (("grpc-retry-pushback-ms", str(int(exc.retry_after * 1000))),)
    await context.abort(_STATUS.get(exc.status, grpc.StatusCode.INTERNAL), exc.message, pushback)


def _usage(prompt: int, generated: int, cached: int) -> inference_pb2.Usage:
    return inference_pb2.Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated,
                               cached_tokens=cached)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """With API keys set, an inference call needs `authorization: Bearer KEY` metadata (UNAUTHENTICATED
    otherwise), the same keys as the HTTP API's."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The method's handler, or one that refuses the call before any of it runs."""
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_SERVICE):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.keys.allows(metadata.get("authorization")):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "a valid API key is required: send metadata 'authorization: Bearer KEY'")

    async def refuse_stream(request, context: grpc.aio.ServicerContext):
        await refuse(request, context)
        yield  # pragma: no cover - abort raises

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class InferenceHealth(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for the inference port: SERVING while some group can serve (the frontend's `healthy()`,
    what GET /health says), NOT_SERVING otherwise; read at each call, so it is never stale."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def _status(self, service: str) -> int | None:
        """The status of `service` ("" is the whole server), None for a service this server does not have."""
        if service not in ("", INFERENCE_SERVICE):
            return None
        up = self.frontend.healthy()
        return health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        """The status now; NOT_FOUND for an unknown service, as the standard asks."""
        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {reprlib.repr(request.service)}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The status, then every change of it, until the client goes away."""
        last = None
        while True:
            status = self._status(request.service)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(HEALTH_WATCH_POLL_S)

    async def List(self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
                   ) -> health_pb2.HealthListResponse:
        """Every service this port has, with its status."""
        statuses = {name: health_pb2.HealthCheckResponse(status=self._status(name)) for name in ("", INFERENCE_SERVICE)}
        return health_pb2.HealthListResponse(statuses=statuses)


# A client that answers nothing any more (cut off without a FIN or an RST, its process stopped) is dropped after a
# ping unanswered for KEEPALIVE_MS, KEEPALIVE_MS after the last: its call is cancelled and its request aborted,
# pages freed, instead of generating to its max_tokens for no one (grpc's default: a ping every two hours).
KEEPALIVE_MS = 20_000


async def start_grpc(frontend: Frontend, host: str, port: int, api_keys: Iterable[str] = ()) -> grpc.aio.Server:
    """Serve the inference service for `frontend` (the coordinator); with `api_keys`, only to their holders."""
    keys = ApiKeys(api_keys)
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys.enabled else [],
                             options=server_options(KEEPALIVE_MS))
    servicer, encode = InferenceServicer(frontend), inference_pb2.GenerateResponse.SerializeToString
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate, decode_request, encode),
                "Complete": grpc.unary_unary_rpc_method_handler(servicer.Complete, decode_request, encode)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(INFERENCE_SERVICE, handlers),))
    # open like HTTP's /health: a probe and grpcurl need no key (the interceptor guards only inference calls)
    health_pb2_grpc.add_HealthServicer_to_server(InferenceHealth(frontend), server)
    reflection.enable_server_reflection((INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    add_port(server, host_port(host, port), "the coordinator's gRPC server")
    await server.start()
    return server
