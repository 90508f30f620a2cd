"""The OpenAI-compatible HTTP API in front of the coordinator.

It only moves data: it validates a request into token ids and sampling parameters, hands it to
the frontend, and turns the token stream back into OpenAI (and vLLM) shaped responses. Every bad
input ends as a 4xx with OpenAI's error body; a client that goes away aborts its request, which
releases its pages on every rank at the next step.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from lockstep.steps import SamplingParams
from lockstep.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger("lockstep.api")

MAX_STOP_STRINGS = 4


class ApiError(Exception):
    """An error the client caused or can retry; rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.err_type = status, message, param, code, err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's output: a token (or none), and why it ended when it did."""

    token_id: int | None
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str = ""
    status: int = 503


@dataclass
class GenerateSpec:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens_given: bool = True


class Frontend(Protocol):
    """What the API needs from the coordinator."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncIterator[TokenEvent]:
        """Queue the request at once (raising ApiError if it cannot be) and return its events."""
    def healthy(self) -> bool: ...
    def health_detail(self) -> dict: ...
    def metrics_text(self) -> bytes: ...
    async def reset_prefix_cache(self, rank: int | None) -> None: ...


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be of type {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be of type {_kind_names(kinds)}, got {type(value).__name__}", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def parse_sampling(body: dict) -> tuple[SamplingParams, int | None, list[str], bool]:
    """Sampling fields shared by both endpoints; returns params, max_tokens, stop strings, ignore_eos."""
    temperature = float(_field(body, "temperature", (int, float), 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _field(body, "top_k", (int,), 0)
    if not -1 <= top_k < 1 << 31:
        raise ApiError(400, f"'top_k' must be -1, 0 (off) or a positive number of tokens, got {top_k}", "top_k")
    seed = _field(body, "seed", (int,), None)
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:
        raise ApiError(400, f"'seed' must be a 64-bit signed integer, got {seed}", "seed")
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got {n}", "n")
    max_tokens = _field(body, "max_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", (int,), None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or up to {MAX_STOP_STRINGS} of them", "stop")
    ignore_eos = _field(body, "ignore_eos", (bool,), False)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed)
    return params, max_tokens, stop, ignore_eos


class OpenAIServer:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/admin/reset_prefix_cache", self.reset_prefix_cache)
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
        model = _field(body, "model", (str,), None)
        if model is not None and model != self.frontend.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.frontend.model_name}'", "model", "model_not_found", "NotFoundError")
        return body

    def spec(self, body: dict, prompt_ids: list[int]) -> GenerateSpec:
        params, max_tokens, stop, ignore_eos = parse_sampling(body)
        limit = self.frontend.max_model_len
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        vocab = self.frontend.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        room = limit - len(prompt_ids)
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                                f"{len(prompt_ids)} tokens", "prompt", "context_length_exceeded")
        given = max_tokens is not None
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(prompt_ids)} tokens and max_tokens is {max_tokens}", "max_tokens",
                           "context_length_exceeded")
        eos = [] if ignore_eos else sorted(self.frontend.tokenizer.eos_token_ids)
        return GenerateSpec(prompt_ids, params, max_tokens, stop, eos, ignore_eos, given)

    async def completions(self, request: web.Request) -> web.StreamResponse:
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
        spec = self.spec(body, prompt_ids)
        return await self._respond(request, body, spec, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
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
        spec = self.spec(body, prompt_ids)
        return await self._respond(request, body, spec, chat=True)

    async def _respond(self, request: web.Request, body: dict, spec: GenerateSpec, chat: bool) -> web.StreamResponse:
        stream = _field(body, "stream", (bool,), False)
        token_ids = _field(body, "return_token_ids", (bool,), False)
        include_usage = bool((_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": created, "model": self.frontend.model_name}
        outputs = self.texts(rid, spec)
        if not stream:
            text, ids, reason, cached = await collect(outputs)
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if token_ids:
                choice["token_ids"] = ids
            out = {**base, "object": kind, "choices": [choice], "usage": _usage(spec, len(ids), cached)}
            if token_ids:
                out["prompt_token_ids"] = spec.prompt_ids
            return web.json_response(out)
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

    async def _stream(self, resp: web.StreamResponse, base: dict, spec: GenerateSpec, outputs, chat: bool,
                      token_ids: bool) -> tuple[int, int]:
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        first = True
        n_out = 0
        cached = 0
        async for piece, new_ids, reason, cached_now in outputs:
            n_out += len(new_ids)
            cached = cached_now
            if chat:
                delta: dict[str, Any] = {"content": piece}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}
            if token_ids:
                choice["token_ids"] = new_ids
            chunk = {**base, "object": chunk_kind, "choices": [choice]}
            if token_ids and first:
                chunk["prompt_token_ids"] = spec.prompt_ids
            first = False
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        return n_out, cached

    def texts(self, rid: str, spec: GenerateSpec) -> AsyncIterator[tuple[str, list[int], str | None, int]]:
        """Queue the request now; then text pieces with their token ids, holding back what could still
        become a stop string."""
        return self._texts(spec, self.frontend.generate(rid, spec))

    async def _texts(self, spec: GenerateSpec, events: AsyncIterator[TokenEvent]
                     ) -> AsyncIterator[tuple[str, list[int], str | None, int]]:
        decoder = IncrementalDecoder(self.frontend.tokenizer)
        hold = max((len(s) for s in spec.stop), default=1) - 1
        text, sent, ids = "", 0, []
        try:
            async for ev in events:
                if ev.error and ev.status < 500:
                    raise ApiError(ev.status, ev.error, "max_tokens", "request_too_large")
                if ev.error:
                    raise ApiError(503, ev.error, code="group_unavailable", err_type="service_unavailable")
                if ev.token_id is not None:
                    ids.append(ev.token_id)
                    text += decoder.add(ev.token_id)
                reason = ev.finish_reason
                cut = _find_stop(text, spec.stop, sent)
                if cut is not None:
                    text, reason = text[:cut], "stop"
                if reason is not None:
                    text += decoder.flush() if cut is None else ""
                    yield text[sent:], ids, reason, ev.cached_tokens
                    return
                safe = len(text) - hold
                if safe > sent:
                    yield text[sent:safe], ids, None, ev.cached_tokens
                    sent, ids = safe, []
        finally:
            await events.aclose()

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.frontend.model_name, "object": "model", "created": 0, "owned_by": "lockstep",
                "max_model_len": self.frontend.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        detail = self.frontend.health_detail()
        return web.json_response(detail, status=200 if self.frontend.healthy() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.frontend.metrics_text(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
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


async def collect(outputs: AsyncIterator[tuple[str, list[int], str | None, int]]) -> tuple[str, list[int], str, int]:
    """The whole answer of a non-streaming request: text, token ids, finish reason, cached prompt tokens."""
    text, ids, reason, cached = "", [], "", 0
    async for piece, new_ids, why, cached_now in outputs:
        text += piece
        ids.extend(new_ids)
        reason, cached = why or reason, cached_now
    return text, ids, reason, cached


def _find_stop(text: str, stops: list[str], sent: int) -> int | None:
    best = None
    for s in stops:
        i = text.find(s, max(0, sent - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _usage(spec: GenerateSpec, completion: int, cached: int) -> dict:
    prompt = len(spec.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def run_app(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

