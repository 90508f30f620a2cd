"""The OpenAI-compatible HTTP API in front of the coordinator.

It only moves data: it reads a request's JSON into token ids and typed sampling fields, which
generation.py validates (the same rules as the gRPC API), hands the spec to the frontend, and turns
the text stream back into OpenAI (and vLLM) shaped responses. Every bad input ends as a 4xx with
OpenAI's error body; a client that goes away aborts its request, which releases its pages on every
rank at the next step.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from lockstep.coordinator.generation import (
    ApiError,
    Completion,
    Frontend,
    GenerateSpec,
    SamplingFields,
    TextPiece,
    build_spec,
    check_model,
    collect,
    generate_text,
    json_field,
)

log = logging.getLogger("lockstep.api")


class OpenAIServer:
    """The HTTP routes; every rule about a request's fields lives in generation.py, shared with gRPC."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def app(self) -> web.Application:
        """The aiohttp application: OpenAI's routes, health and metrics, and the operators' /admin routes."""
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/admin/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/admin/steps", self.steps)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            err = ApiError(exc.status, exc.reason or "error", err_type="invalid_request_error")
            return web.json_response(err.body(), status=exc.status)

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        check_model(self.frontend, json_field(body, "model", (str,)))
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: `prompt` is a string or a list of token ids (or a list of one of them)."""
        body = await self._json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.frontend.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")
        spec = build_spec(self.frontend, SamplingFields.from_json(body), prompt_ids)
        return await self._respond(request, body, spec, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: the messages go through the model's chat template."""
        body = await self._json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty array", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), (str, type(None))
            ):
                raise ApiError(400, "each message must be an object with a string 'role' and 'content'", "messages")
        try:
            text = self.frontend.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as exc:
            raise ApiError(400, f"the chat template could not be applied: {exc}", "messages") from exc
        prompt_ids = self.frontend.tokenizer.encode(text, add_special_tokens=False)
        spec = build_spec(self.frontend, SamplingFields.from_json(body), prompt_ids)
        return await self._respond(request, body, spec, chat=True)

    async def _respond(self, request: web.Request, body: dict, spec: GenerateSpec, chat: bool) -> web.StreamResponse:
        stream = json_field(body, "stream", (bool,), False)
        token_ids = json_field(body, "return_token_ids", (bool,), False)
        include_usage = bool((json_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        base = {"id": rid, "created": int(time.time()), "model": self.frontend.model_name}
        outputs = generate_text(self.frontend, rid, spec)
        if not stream:
            return web.json_response(self._whole(base, spec, await collect(outputs), chat, token_ids))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            n_out, cached = await self._stream(resp, base, spec, outputs, chat, token_ids)
        except ConnectionResetError:
            log.info("client of %s went away; its request is aborted", rid)
            return resp
        except ApiError as exc:
            await resp.write(f"data: {json.dumps(exc.body())}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        if include_usage:
            chunk = {**base, "object": chunk_kind, "choices": [], "usage": _usage(spec, n_out, cached)}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _whole(base: dict, spec: GenerateSpec, done: Completion, chat: bool, token_ids: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        if token_ids:
            choice["token_ids"] = done.token_ids
        kind = "chat.completion" if chat else "text_completion"
        out = {**base, "object": kind, "choices": [choice], "usage": _usage(spec, len(done.token_ids),
                                                                             done.cached_tokens)}
        if token_ids:
            out["prompt_token_ids"] = spec.prompt_ids
        return out

    async def _stream(self, resp: web.StreamResponse, base: dict, spec: GenerateSpec,
                      outputs: AsyncGenerator[TextPiece, None], chat: bool, token_ids: bool) -> tuple[int, int]:
        """Write one server-sent event per text piece; returns the tokens sent and the cached prompt tokens."""
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        first = True
        n_out = 0
        cached = 0
        async with aclosing(outputs):
            async for piece in outputs:
                n_out += len(piece.token_ids)
                cached = piece.cached_tokens
                choice = _stream_choice(piece, chat, first)
                if token_ids:
                    choice["token_ids"] = piece.token_ids
                chunk = {**base, "object": chunk_kind, "choices": [choice]}
                if token_ids and first:
                    chunk["prompt_token_ids"] = spec.prompt_ids
                first = False
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        return n_out, cached

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model."""
        card = {"id": self.frontend.model_name, "object": "model", "created": 0, "owned_by": "lockstep",
                "max_model_len": self.frontend.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while some group can serve, 503 otherwise; the body says which group is how."""
        detail = self.frontend.health_detail()
        return web.json_response(detail, status=200 if self.frontend.healthy() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text."""
        return web.Response(body=self.frontend.metrics_text(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /admin/reset_prefix_cache[?rank=N]: drop the prefix cache of every rank, or of rank N."""
        rank = request.query.get("rank")
        if rank is None and request.can_read_body:
            body = await self._json(request)
            rank = body.get("rank")
        try:
            rank_no = None if rank is None else int(rank)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, f"'rank' must be an integer, got {rank!r}", "rank") from exc
        try:
            await self.frontend.reset_prefix_cache(rank_no)
        except ValueError as exc:
            raise ApiError(400, str(exc), "rank") from exc
        return web.json_response({"status": "ok", "rank": rank_no})

    async def steps(self, request: web.Request) -> web.Response:
        """GET /admin/steps[?group=G][&since=N]: a group's step timings (read-only; `lockstep bench` reads it
        to tell the coordinator's own time from the wait for the ranks)."""
        group = request.query.get("group")
        since = request.query.get("since", "0")
        try:
            since_no = int(since)
        except ValueError as exc:
            raise ApiError(400, f"'since' must be an integer, got {since!r}", "since") from exc
        if since_no < 0:
            raise ApiError(400, f"'since' must be at least 0, got {since_no}", "since")
        try:
            return web.json_response(self.frontend.step_log(group, since_no))
        except KeyError as exc:
            raise ApiError(404, f"there is no group {group!r}" if group is not None else "there is no group",
                           "group", "group_not_found", "NotFoundError") from exc


def _stream_choice(piece: TextPiece, chat: bool, first: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": piece.text, "finish_reason": piece.finish_reason, "logprobs": None}
    delta: dict[str, Any] = {"content": piece.text}
    if first:
        delta["role"] = "assistant"
    return {"index": 0, "delta": delta, "finish_reason": piece.finish_reason, "logprobs": None}


def _usage(spec: GenerateSpec, completion: int, cached: int) -> dict:
    prompt = len(spec.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def run_app(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve the app (no access log: /metrics is scraped every few seconds)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
