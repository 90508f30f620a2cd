"""The gRPC inference service: the same validation and token stream as the HTTP API, over protobuf."""

from __future__ import annotations

import uuid

import grpc

from lockstep.coordinator.openai_api import ApiError, OpenAIServer, collect
from lockstep.proto_gen.lockstep.v1 import inference_pb2, inference_pb2_grpc

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
           503: grpc.StatusCode.UNAVAILABLE}


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, api: OpenAIServer) -> None:
        self.api = api

    def _request(self, req: inference_pb2.GenerateRequest):
        fe = self.api.frontend
        if req.model and req.model != fe.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{fe.model_name}'")
        body: dict = {"stop": list(req.stop)}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            if req.HasField(name):
                body[name] = getattr(req, name)
        which = req.WhichOneof("prompt")
        if which == "text":
            prompt_ids = fe.tokenizer.encode(req.text)
        elif which == "token_ids":
            prompt_ids = list(req.token_ids.ids)
        else:
            raise ApiError(400, "the request has no prompt (text or token_ids)")
        return self.api.spec(body, prompt_ids), req.request_id or ("cmpl-" + uuid.uuid4().hex)

    async def Generate(self, request, context):
        try:
            spec, rid = self._request(request)
            first = True
            async for text, ids, reason, _ in self.api.texts(rid, spec):
                msg = inference_pb2.GenerateResponse(request_id=rid, text=text, token_ids=ids,
                                                     finish_reason=reason or "")
                if first and request.return_token_ids:
                    msg.prompt_token_ids.extend(spec.prompt_ids)
                first = False
                yield msg
        except ApiError as exc:
            await context.abort(_STATUS.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

    async def Complete(self, request, context):
        try:
            spec, rid = self._request(request)
            text, ids, reason, cached = await collect(self.api.texts(rid, spec))
        except ApiError as exc:
            await context.abort(_STATUS.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
        usage = inference_pb2.Usage(prompt_tokens=len(spec.prompt_ids), completion_tokens=len(ids),
                                    total_tokens=len(spec.prompt_ids) + len(ids), cached_tokens=cached)
        msg = inference_pb2.GenerateResponse(request_id=rid, text=text, finish_reason=reason or "", usage=usage)
        if request.return_token_ids:
            msg.token_ids.extend(ids)
            msg.prompt_token_ids.extend(spec.prompt_ids)
        return msg


async def start_grpc(api: OpenAIServer, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(api), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server
