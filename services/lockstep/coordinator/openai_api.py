"""The OpenAI-compatible HTTP API in front of the coordinator.

It only moves data: it reads a request's JSON into token ids and typed sampling fields, which
generation.py validates (the same rules as the gRPC API), hands the spec to the frontend, and turns
the text stream back into OpenAI (and vLLM) shaped responses. Every bad input ends as a 4xx with
OpenAI's error body; a client that goes away aborts its request, which releases its pages on every
rank at the next step.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

import lockstep
from lockstep.coordinator.auth import ApiKeys
from lockstep.coordinator.generation import (
    ApiError,
    Frontend,
    SamplingFields,
    build_spec,
    check_model,
    is_json_integer,
    json_field,
)
from lockstep.coordinator.openai_fields import (
    MAX_BODY_BYTES,
    check_echo,
    check_fields,
    check_messages,
    check_shadowed_max_tokens,
    load_body,
    max_logprobs_of,
)
from lockstep.coordinator.openai_output import ClientGone, Shape, internal_error, respond
from lockstep.coordinator.openapi import OPEN_PATHS, QUERY_PARAMS, openapi_document
from lockstep.coordinator.prompt_encoding import OFF_LOOP_CHARS, encode_prompt, off_loop
from lockstep.coordinator.request_events import settled
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.api")
SHUTDOWN_GRACE_S = 5.0  # how long streams in flight may go on once the coordinator is told to stop
KEEP_ALIVE_S = 5.0  # how long an idle connection stays open (config.http_keep_alive)
_QUERY_INT = re.compile(r"-?[0-9]{1,18}")
_PROMPT_KINDS = "'prompt' must be a string or a list of token ids"


class _MalformedRequests(logging.Filter):
    """aiohttp logs a traceback at ERROR for each request its parser refuses (a port scanner's, a header over
    8 KB, a method of a megabyte), and for a body it could not decode as it drains it after the answer (a
    Content-Encoding the bytes are not in): one WARNING line each instead, cut short, so a bad client cannot fill
    the log or page whoever watches its errors. The client still gets a 400."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        malformed = isinstance(exc, (HttpProcessingError, RequestPayloadError))
        if malformed and record.levelno > logging.WARNING:  # aiohttp's DEBUG ones stay
            text = " ".join(str(exc).split())  # one line: the parser's message spans several
            args = record.args if isinstance(record.args, tuple) else ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "refused a malformed HTTP request from %s: %s"
            record.args = (args[0] if args else "?", text[:200] + "..." * (len(text) > 200))
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_parser_errors() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _MalformedRequests) for f in logger.filters):
        logger.addFilter(_MalformedRequests())


class OpenAIServer:
    """The HTTP routes; every rule about a request's fields lives in generation.py, shared with gRPC."""

    def __init__(self, frontend: Frontend, api_keys: Iterable[str] = (), max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.frontend = frontend
        self.keys = ApiKeys(api_keys)
        self.max_body_bytes = max_body_bytes
        self._document: dict | None = None

    def app(self) -> web.Application:
        """The aiohttp application: OpenAI's routes, health and metrics, and the operators' /admin routes."""
        _quiet_parser_errors()
        app = web.Application(middlewares=[self._errors, self._auth, self._query],
                              client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)  # a served name may hold "/" (org/model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/version", self.version)
        app.router.add_post("/admin/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/admin/steps", self.steps)
        app.router.add_post("/admin/drain", self.drain)
        app.router.add_post("/admin/resume", self.resume)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every failure as OpenAI's error body: the client's (4xx) and, logged, our own (500)."""
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
        except (ClientGone, ConnectionResetError):
            log.info("client of %s %s went away; its request is aborted", request.method, request.path)
            return web.Response(status=499)
        except RequestPayloadError as exc:  # the body is not in its Content-Encoding (the client's mistake)
            why = " ".join(str(exc.__cause__ or exc).split())
            resp = web.json_response(ApiError(400, f"the request body could not be read: {why[:200]}").body(),
                                     status=400)
            resp.force_close()  # the rest of the body cannot be read either: the connection ends with this answer
            return resp
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.status == 413 and exc.text else exc.reason or "error"
            err = ApiError(exc.status, message, err_type="invalid_request_error")
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return web.json_response(err.body(), status=exc.status, headers=headers)
        except Exception as exc:
            return web.json_response(internal_error(request, exc).body(), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """With API keys set, everything but the open paths needs `Authorization: Bearer KEY`."""
        if request.path not in OPEN_PATHS and not self.keys.allows(request.headers.get("Authorization")):
            err = ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", err_type="authentication_error")
            return web.json_response(err.body(), status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    @web.middleware
    async def _query(self, request: web.Request, handler) -> web.StreamResponse:
        """A query parameter that the route does not take is a 400 naming it, like a body field."""
        resource = request.match_info.route.resource
        allowed = QUERY_PARAMS.get(resource.canonical, ()) if resource is not None else None
        unknown = [k for k in request.query if allowed is not None and k not in allowed]
        if unknown:
            raise ApiError(400, f"unsupported query parameter '{unknown[0]}'", unknown[0], "unsupported_field")
        return await handler(request)

    async def _json(self, request: web.Request, endpoint: str, body: dict | None = None) -> dict:
        """The body (read now unless given), its fields checked for `endpoint`, and the model it names."""
        body = await _read_body(request) if body is None else body
        check_fields(body, endpoint, max_logprobs_of(self.frontend))
        if endpoint != "reset_prefix_cache":
            check_model(self.frontend, json_field(body, "model", (str,)))
            check_shadowed_max_tokens(body, self.frontend.max_model_len)
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: `prompt` is a string or a list of token ids (or a list of one of them)."""
        body = await self._json(request, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await encode_prompt(self.frontend.tokenizer, prompt)
        elif isinstance(prompt, list):  # millions of ids take a second to check: in a thread, as a long text
            prompt_ids = await off_loop(len(prompt), _prompt_ids, prompt)
        else:
            raise ApiError(400, _PROMPT_KINDS, "prompt")
        spec = build_spec(self.frontend, SamplingFields.from_json(body), prompt_ids)
        echo = ""
        if check_echo(body):  # the prompt's text: as given, or its token ids decoded with their special tokens
            echo = prompt if isinstance(prompt, str) else self.frontend.tokenizer.decode(prompt_ids, False)
        return await respond(request, self.frontend, body, spec, Shape(False, _token_ids(body), echo))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: the messages go through the model's chat template."""
        body = await self._json(request, "chat")
        text = await self._chat_text(check_messages(body.get("messages")))
        prompt_ids = await encode_prompt(self.frontend.tokenizer, text, add_special_tokens=False)
        spec = build_spec(self.frontend, SamplingFields.from_json(body), prompt_ids)
        return await respond(request, self.frontend, body, spec, Shape(True, _token_ids(body)))

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize (vLLM's): a `prompt`, or `messages` rendered by the chat template as /v1/chat would,
        to token ids, so a client can count tokens against max_model_len before it sends a request."""
        raw = await _read_body(request)
        body = await self._json(request, "tokenize_chat" if "messages" in raw else "tokenize", raw)
        tokenizer = self.frontend.tokenizer
        if "messages" in body:
            text = await self._chat_text(check_messages(body.get("messages")),
                                         json_field(body, "add_generation_prompt", (bool,), True))
            special = json_field(body, "add_special_tokens", (bool,), False)
        else:
            text = json_field(body, "prompt", (str,))
            if text is None:
                raise ApiError(400, "the request needs a 'prompt' (a string) or 'messages'", "prompt")
            special = json_field(body, "add_special_tokens", (bool,), True)
        ids = await encode_prompt(tokenizer, text, add_special_tokens=special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.frontend.max_model_len, "tokens": ids}
        if json_field(body, "return_token_strs", (bool,), False):
            # vLLM's convert_ids_to_tokens: the vocabulary's strings ("▁world"), which a one-id decode would strip
            out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return web.Response(text=await off_loop(len(ids), json.dumps, out), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize (vLLM's): token ids to their text, special tokens kept, so it inverts /tokenize."""
        body = await self._json(request, "detokenize")
        tokens = json_field(body, "tokens", (list,))
        if tokens is None:
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        # 4 MB of ids (2 million) take a second and a half to check and decode: in a thread, as /tokenize's texts
        text = await off_loop(len(tokens), _detokenized, self.frontend.tokenizer, tokens, len(tokens) > OFF_LOOP_CHARS)
        return web.json_response({"prompt": text})

    async def _chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat, or a 400 when the model's template refuses it; a long chat is rendered in
        a thread (the loop still runs between the template's steps), as its text is encoded."""
        render = functools.partial(self.frontend.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=add_generation_prompt)
        try:
            return await off_loop(sum(len(str(m.get("content", ""))) for m in messages) + len(messages), render)
        except ValueError as exc:
            raise ApiError(400, f"the chat template could not be applied: {exc}", "messages") from exc

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model."""
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: OpenAI's retrieve (the `openai` client's `models.retrieve`); another name is
        a 404 naming the served one."""
        check_model(self.frontend, request.match_info["model"])
        return web.json_response(self._card())

    def _card(self) -> dict:
        return {"id": self.frontend.model_name, "object": "model", "created": 0, "owned_by": "lockstep",
                "max_model_len": self.frontend.max_model_len}

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while some group can serve, 503 otherwise; the body says which group is how."""
        detail = await settled(self.frontend.health_detail())
        return web.json_response(detail, status=200 if self.frontend.healthy() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text."""
        return web.Response(body=await settled(self.frontend.metrics_text()),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def openapi(self, request: web.Request) -> web.Response:
        """GET /openapi.json: the OpenAPI 3.1 document of this API, with this model's limits."""
        if self._document is None:
            self._document = openapi_document(self.frontend.model_name, self.frontend.max_model_len,
                                              self.frontend.tokenizer.vocab_size, lockstep.__version__,
                                              max_logprobs_of(self.frontend))
        return web.json_response(self._document)

    async def version(self, request: web.Request) -> web.Response:
        """GET /version: the Lockstep version serving (vLLM's shape)."""
        return web.json_response({"version": lockstep.__version__})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /admin/reset_prefix_cache[?rank=N]: drop the prefix cache of every rank, or of rank N."""
        rank = _query_int(request, "rank", 0)
        if request.can_read_body:
            given = json_field(await self._json(request, "reset_prefix_cache"), "rank", (int,))
            if given is not None and given < 0:
                raise ApiError(400, "'rank' must be at least 0", "rank")
            if given is not None and rank is not None and given != rank:
                raise ApiError(400, "'rank' is given twice (query and body) with different values", "rank")
            rank = given if rank is None else rank
        try:
            await self.frontend.reset_prefix_cache(rank)
        except ValueError as exc:
            raise ApiError(400, str(exc), "rank") from exc
        return web.json_response({"status": "ok", "rank": rank})

    async def steps(self, request: web.Request) -> web.Response:
        """GET /admin/steps[?group=G][&since=N]: a group's step timings (read-only; `lockstep bench` reads it
        to tell the coordinator's own time from the wait for the ranks)."""
        group = request.query.get("group")
        since = _query_int(request, "since", 0) or 0
        try:
            return web.json_response(await settled(self.frontend.step_log(group, since)))
        except KeyError as exc:
            raise ApiError(404, f"there is no group {group!r}" if group is not None else "there is no group",
                           "group", "group_not_found", "NotFoundError") from exc


    async def drain(self, request: web.Request) -> web.Response:
        """POST /admin/drain?group=G[&migrate=true]: G takes no new request; 200 once it holds nothing (its
        requests finished, or with migrate=true moved to other groups at the next step boundary)."""
        group = _group_query(request)
        migrate = request.query.get("migrate", "false")
        if migrate not in ("true", "false"):
            raise ApiError(400, f"'migrate' must be true or false, got {migrate[:40]!r}", "migrate")
        try:
            return web.json_response(await self.frontend.drain(group, migrate == "true"))
        except KeyError as exc:
            raise ApiError(404, f"there is no group {group!r}", "group", "group_not_found", "NotFoundError") from exc

    async def resume(self, request: web.Request) -> web.Response:
        """POST /admin/resume?group=G: G takes new requests again."""
        group = _group_query(request)
        try:
            return web.json_response(await settled(self.frontend.resume(group)))
        except KeyError as exc:
            raise ApiError(404, f"there is no group {group!r}", "group", "group_not_found", "NotFoundError") from exc


def _group_query(request: web.Request) -> str:
    group = request.query.get("group")
    if not group:
        raise ApiError(400, "'group' is required (the group's name, as in /health)", "group")
    return group


async def _read_body(request: web.Request) -> dict:
    """The request's JSON body, checked (openai_fields.load_body); a large one in a thread, as a long prompt is
    encoded: 4 MB of token ids take 0.4 s to parse and check."""
    raw = await request.read()
    return await off_loop(len(raw), load_body, raw)


def _prompt_ids(prompt: list) -> list[int]:
    """A completion's prompt given as token ids (JSON integers), or a 400."""
    if not all(is_json_integer(t) for t in prompt):
        raise ApiError(400, _PROMPT_KINDS, "prompt")
    return [int(t) for t in prompt]


def _detokenized(tokenizer: Tokenizer, tokens: list, unlocked: bool) -> str:
    """/detokenize's text: the ids checked, then decoded with their special tokens (`unlocked`: in a thread, by the
    backend's call that releases the GIL)."""
    if not all(is_json_integer(t) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
    decode = tokenizer.decode_unlocked if unlocked else tokenizer.decode
    try:
        return decode([int(t) for t in tokens], False)
    except ValueError as exc:
        raise ApiError(400, str(exc), "tokens") from exc


def _token_ids(body: dict) -> bool:
    """vLLM's return_token_ids: prompt_token_ids and choices[].token_ids in the answer."""
    return json_field(body, "return_token_ids", (bool,), False)


def _query_int(request: web.Request, name: str, minimum: int) -> int | None:
    """An integer query parameter (None if absent): plain ASCII digits, at least `minimum`."""
    text = request.query.get(name)
    if text is None:
        return None
    if not _QUERY_INT.fullmatch(text):
        raise ApiError(400, f"'{name}' must be an integer of at most 18 digits, got {text[:40]!r}", name)
    value = int(text)
    if value < minimum:
        raise ApiError(400, f"'{name}' must be at least {minimum}, got {value}", name)
    return value


async def run_app(app: web.Application, host: str, port: int, shutdown_grace: float = SHUTDOWN_GRACE_S,
                  reuse_port: bool = False, keep_alive: float = KEEP_ALIVE_S) -> web.AppRunner:
    """Serve the app (no access log: /metrics is scraped every few seconds).

    `runner.cleanup()` stops listening at once, then gives the requests in flight `shutdown_grace`
    seconds to finish and cuts the rest off (aiohttp's default, 60 s, would hold a Ctrl-C up that long). With
    `reuse_port`, processes share the port (API frontends: api_workers.py). A connection idle for `keep_alive`
    seconds, or that has not sent a whole request line and headers by then, is closed (aiohttp >= 3.14.4 times a
    new connection too): aiohttp's 75 s let a few hundred idle or byte-a-second clients hold their sockets that
    long. A request body still arriving, a request waiting in the queue and a stream are not timed."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_grace, keepalive_timeout=keep_alive)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
    return runner
