"""The response side of the HTTP API: a queued request's choices rendered as OpenAI (and vLLM) responses.

A request's n choices are queued together (choices.py); a non-streaming client gets them all in one body,
a streaming one gets server-sent events, each chunk one piece of one choice with its `index`. Usage counts
the prompt once and the completion tokens of every choice. A client that hangs up has every choice aborted,
which releases its pages on every rank at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from aiohttp import web

from lockstep.coordinator.choices import collect_choices, interleave, open_choices
from lockstep.coordinator.generation import (
    ApiError,
    Completion,
    Frontend,
    GenerateSpec,
    TextPiece,
    json_field,
)
from lockstep.coordinator.openai_fields import (
    check_echo,
    logprobs_asked,
    max_logprobs_of,
    prompt_logprobs_asked,
    stream_options,
)
from lockstep.steps import TokenLogprobs
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.api")
T = TypeVar("T")
DISCONNECT_POLL_S = 0.2  # how soon a client that hung up has its request aborted
LOGPROB_FLOOR = -9999.0  # what -inf (and NaN) render as: JSON has no infinity (vLLM's and OpenAI's value)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


@dataclass(frozen=True)
class Shape:
    """How the answer is rendered: chat or completion, with token ids or not, the echoed prompt text."""

    chat: bool
    token_ids: bool = False
    echo: str = ""  # completions' echo: the prompt's text, put before each choice's text
    logprobs: int = -1  # top logprobs per token (-1: no logprobs at all)
    echo_logprobs: bool = False  # completions' echo with logprobs: the prompt's tokens are scored too
    prompt_logprobs: int = -1  # vLLM's prompt_logprobs: the k most likely at each prompt position (-1: off)

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


async def unless_gone(request: web.Request, work: Awaitable[T]) -> T:
    """Run `work` until it ends or the client hangs up. A client that hangs up has `work` cancelled, which
    closes its request's events: the request aborts and frees its pages and its batch seat at once. (aiohttp
    cancels a handler on disconnect only when its runner is made with handler_cancellation; this does not
    depend on it.)"""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def internal_error(request: web.Request, exc: Exception) -> ApiError:
    """Our own bug, logged with its traceback; the client learns only that it happened."""
    log.error("internal error serving %s %s", request.method, request.path, exc_info=exc)
    return ApiError(500, "internal error; the coordinator logged it", err_type="server_error")


async def respond(request: web.Request, frontend: Frontend, body: dict, spec: GenerateSpec, shape: Shape
                  ) -> web.StreamResponse:
    """Queue the request's n choices (a refusal is an HTTP status, before any output) and answer with them."""
    stream = json_field(body, "stream", (bool,), False)
    include_usage = stream_options(body, stream)
    k = logprobs_asked(body, shape.chat, max_logprobs_of(frontend))
    if k >= 0:  # the ranks compute them where they sample (SamplingParams.logprobs)
        spec, shape = replace(spec, sampling=replace(spec.sampling, logprobs=k)), replace(shape, logprobs=k)
        if not shape.chat and check_echo(body):  # and the prompt's, where they compute it
            spec = replace(spec, sampling=replace(spec.sampling, prompt_logprobs=k))
            shape = replace(shape, echo_logprobs=True)
    pk = -1 if shape.chat else prompt_logprobs_asked(body, max_logprobs_of(frontend))
    if pk >= 0:
        spec = replace(spec, sampling=replace(spec.sampling, prompt_logprobs=max(pk, spec.sampling.prompt_logprobs)))
        shape = replace(shape, prompt_logprobs=pk)
    rid = ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex
    base = {"id": rid, "created": int(time.time()), "model": frontend.model_name}
    choices = await open_choices(frontend, rid, spec)
    try:
        if not stream:
            done = await unless_gone(request, collect_choices(choices.streams))
            return web.json_response(whole(base, spec, done, shape, frontend.tokenizer))
        return await _event_stream(request, base, spec, choices.streams, shape, include_usage, frontend.tokenizer)
    finally:
        await choices.aclose()  # a no-op once every choice ended; else (a client gone) each is aborted


def whole(base: dict, spec: GenerateSpec, done: Sequence[Completion], shape: Shape, tokenizer: Tokenizer) -> dict:
    """The body of a non-streaming answer (the tokenizer renders logprobs' tokens, when asked for)."""
    choices = []
    for i, one in enumerate(done):
        lps = None
        if shape.echo_logprobs:  # the prompt's tokens, then the generated ones, text offsets counting on
            prompt, offset = render_prompt(tokenizer, shape, spec.prompt_ids, one.prompt_logprobs)
            lps = _with_prompt(prompt, render_logprobs(tokenizer, shape, one.token_ids, one.logprobs, offset)[0])
        elif shape.logprobs >= 0:
            lps = render_logprobs(tokenizer, shape, one.token_ids, one.logprobs, len(shape.echo))[0]
        choice: dict[str, Any] = {"index": i, "finish_reason": one.finish_reason, "stop_reason": one.stop_reason,
                                  "logprobs": lps}
        if shape.chat:
            choice["message"] = {"role": "assistant", "content": one.text}
        else:
            choice["text"] = shape.echo + one.text
        if shape.token_ids:
            choice["token_ids"] = one.token_ids
        if shape.prompt_logprobs >= 0:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, shape, spec.prompt_ids, one.prompt_logprobs)
        choices.append(choice)
    completion = sum(len(one.token_ids) for one in done)
    out = {**base, "object": shape.kind, "choices": choices, "usage": usage(spec, completion, done[0].cached_tokens)}
    if shape.token_ids:
        out["prompt_token_ids"] = spec.prompt_ids
    return out


async def _event_stream(request: web.Request, base: dict, spec: GenerateSpec,
                        streams: Sequence[AsyncGenerator[TextPiece, None]], shape: Shape,
                        include_usage: bool, tokenizer: Tokenizer) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        n_out, cached = await unless_gone(request, _write_chunks(resp, base, spec, streams, shape, tokenizer))
    except (ConnectionResetError, ClientGone):
        log.info("client of %s went away; its request is aborted", base["id"])
        return resp
    except Exception as exc:  # after the 200 went out, an error can only be an event of the stream
        err = exc if isinstance(exc, ApiError) else internal_error(request, exc)
        await resp.write(f"data: {json.dumps(err.body())}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if include_usage:
        chunk = {**base, "object": shape.kind + ".chunk" if shape.chat else shape.kind, "choices": [],
                 "usage": usage(spec, n_out, cached)}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _write_chunks(resp: web.StreamResponse, base: dict, spec: GenerateSpec,
                        streams: Sequence[AsyncGenerator[TextPiece, None]], shape: Shape, tokenizer: Tokenizer
                        ) -> tuple[int, int]:
    """One server-sent event per text piece of any choice; returns the tokens sent (all choices) and the cached
    prompt tokens (of choice 0, as for n=1). A piece's tokens' logprobs go in its chunk (vLLM's way), their
    text_offset counting on from the choice's previous chunks."""
    kind = shape.kind + ".chunk" if shape.chat else shape.kind
    started = [False] * len(streams)
    n_out, cached, offsets = 0, [0] * len(streams), [len(shape.echo)] * len(streams)
    async with aclosing(interleave(streams)) as pieces:
        async for i, piece in pieces:
            n_out += len(piece.token_ids)
            cached[i] = piece.cached_tokens
            choice = _stream_choice(i, piece, shape, not started[i])
            if shape.logprobs >= 0:
                prompt = None
                if shape.echo_logprobs and not started[i]:  # the echoed prompt's go first, with its text
                    prompt, offsets[i] = render_prompt(tokenizer, shape, spec.prompt_ids, piece.prompt_logprobs)
                choice["logprobs"], offsets[i] = render_logprobs(tokenizer, shape, piece.token_ids, piece.logprobs,
                                                                 offsets[i])
                if prompt is not None:
                    choice["logprobs"] = _with_prompt(prompt, choice["logprobs"])
            if shape.prompt_logprobs >= 0 and not started[i]:  # vLLM's: in a choice's first chunk
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, shape, spec.prompt_ids,
                                                                 piece.prompt_logprobs)
            chunk = {**base, "object": kind, "choices": [choice]}
            if shape.token_ids and not any(started):
                chunk["prompt_token_ids"] = spec.prompt_ids
            started[i] = True
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    return n_out, cached[0]


def _stream_choice(index: int, piece: TextPiece, shape: Shape, first: bool) -> dict[str, Any]:
    if shape.chat:
        delta: dict[str, Any] = {"content": piece.text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "finish_reason": piece.finish_reason, "logprobs": None}
    else:
        text = shape.echo + piece.text if first else piece.text
        choice = {"index": index, "text": text, "finish_reason": piece.finish_reason, "logprobs": None}
    choice["stop_reason"] = piece.stop_reason  # vLLM's: null until the chunk that carries the finish reason
    if shape.token_ids:
        choice["token_ids"] = piece.token_ids
    return choice


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, as vLLM shows it in logprobs (decoded alone, special tokens kept); an id past the
    tokenizer's vocabulary (a padded embedding) has none."""
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except ValueError:
        return ""


def _logprob(value: float | None) -> float | None:
    """A logprob JSON can carry: no lower than LOGPROB_FLOOR, which -inf and NaN become (vLLM's rule)."""
    if value is None:
        return None
    return max(value, LOGPROB_FLOOR) if math.isfinite(value) else LOGPROB_FLOOR


def render_logprobs(tokenizer: Tokenizer, shape: Shape, token_ids: Sequence[int],
                    logprobs: Sequence[TokenLogprobs | None], offset: int) -> tuple[dict, int]:
    """(a choice's `logprobs` for these tokens, the text offset after them). Chat: OpenAI's `content` entries,
    each with the `top_logprobs` k most likely. Completions: the legacy parallel lists, where each position's
    `top_logprobs` holds the k most likely and the sampled token (so up to k + 1 entries, as OpenAI and vLLM)."""
    texts: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in texts:
            texts[t] = token_text(tokenizer, t)
        return texts[t]

    lps = list(logprobs) + [None] * (len(token_ids) - len(logprobs))
    if shape.chat:
        content = [{"token": text(t), "logprob": _logprob(lp.logprob if lp else None),
                    "bytes": list(tokenizer.token_bytes(t)),
                    "top_logprobs": [{"token": text(i), "logprob": _logprob(v), "bytes": list(tokenizer.token_bytes(i))}
                                     for i, v in (lp.top[:shape.logprobs] if lp else ())]}
                   for t, lp in zip(token_ids, lps, strict=True)]
        return {"content": content}, offset
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(token_ids, lps, strict=True):
        out["tokens"].append(text(t))
        out["token_logprobs"].append(_logprob(lp.logprob if lp else None))
        top: dict[str, float | None] = {}
        for i, v in (lp.top[:shape.logprobs] if lp else ()):
            top.setdefault(text(i), _logprob(v))
        if lp is not None:
            top.setdefault(text(t), _logprob(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text(t))
    return out, offset


def render_prompt(tokenizer: Tokenizer, shape: Shape, prompt_ids: Sequence[int],
                  prompt_logprobs: Sequence[TokenLogprobs] | None) -> tuple[dict, int]:
    """(the echoed prompt's part of a completion's `logprobs`, the text offset after it), in OpenAI's and vLLM's
    shape: the first token's logprob and top_logprobs are null, since nothing predicts it; token i's come
    from position i - 1. Text offsets count from 0 over the tokens' texts, and the generated ones go on."""
    out, offset = render_logprobs(tokenizer, shape, prompt_ids, [None, *(prompt_logprobs or ())][:len(prompt_ids)], 0)
    out["top_logprobs"][0] = None
    return out, offset


def vllm_prompt_logprobs(tokenizer: Tokenizer, shape: Shape, prompt_ids: Sequence[int],
                         prompt_logprobs: Sequence[TokenLogprobs] | None) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: null for the first token, then per position the prompt token and
    the k most likely, keyed by token id, each {logprob, rank (1: the most likely), decoded_token}."""
    out: list[dict | None] = [None]
    lps = list(prompt_logprobs or ())
    for i, t in enumerate(prompt_ids[1:]):
        lp = lps[i] if i < len(lps) else None
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": _logprob(lp.logprob), "rank": lp.rank, "decoded_token": token_text(tokenizer, t)}}
        for rank, (j, v) in enumerate(lp.top[:shape.prompt_logprobs], start=1):
            entry.setdefault(str(j), {"logprob": _logprob(v), "rank": rank, "decoded_token": token_text(tokenizer, j)})
        out.append(entry)
    return out


def _with_prompt(prompt: dict, generated: dict) -> dict:
    return {name: prompt[name] + generated[name] for name in generated}


def usage(spec: GenerateSpec, completion: int, cached: int) -> dict:
    """OpenAI's usage: the prompt once, the completion tokens of every choice."""
    prompt = len(spec.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
