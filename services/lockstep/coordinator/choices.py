"""The n choices of one request (OpenAI's `n`): each is a request of its own to the coordinator.

A request with n > 1 fans out into n coordinator requests, queued together or not at all, each with its
own sampling stream; their text streams are interleaved for a streaming client and collected for the
others. Closing the merged stream (a client gone, an error in one choice) aborts every choice. Nothing here
imports a transport: the HTTP API renders the choices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from lockstep.coordinator.generation import (
    SEED_MIN,
    Completion,
    Frontend,
    GenerateSpec,
    TextPiece,
    TokenEvent,
    text_stream,
)
from lockstep.coordinator.request_events import settled


def choice_specs(spec: GenerateSpec) -> list[GenerateSpec]:
    """The spec of each of the n choices, each a request of its own. With a seed, choice i draws with seed + i
    (vLLM's rule, wrapped to 64 bits), so choice 0 is the n=1 answer and no two choices share a stream;
    without one, each choice's request draws a fresh seed of its own (`request.default_seed`)."""
    if spec.n == 1:
        return [spec]
    seed = spec.sampling.seed
    return [replace(spec, n=1, choice=i, sampling=spec.sampling if seed is None else replace(
        spec.sampling, seed=(seed + i - SEED_MIN) % (1 << 64) + SEED_MIN)) for i in range(spec.n)]


def choice_ids(request_id: str, n: int) -> list[str]:
    """The coordinator's request id of each choice (one choice keeps the client's id)."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def _joined(pieces: Sequence[TextPiece]) -> Completion:
    """One choice's pieces as its whole answer: the finish reason and stop_reason are the last piece's."""
    ends = [p for p in pieces if p.finish_reason is not None]
    return Completion("".join(p.text for p in pieces), [t for p in pieces for t in p.token_ids],
                      ends[-1].finish_reason if ends else None, pieces[-1].cached_tokens if pieces else 0,
                      [lp for p in pieces for lp in p.logprobs] or (),
                      next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None),
                      ends[-1].stop_reason if ends else None)


# ----- n choices


@dataclass
class Choices:
    """The n choices of one request, queued: their specs, the coordinator's events, and their text."""

    specs: list[GenerateSpec]
    events: list[AsyncGenerator[TokenEvent, None]]
    streams: list[AsyncGenerator[TextPiece, None]]

    async def aclose(self) -> None:
        """Abort every choice that has not ended (closing unstarted text streams would not reach the events)."""
        for stream in self.streams:
            await stream.aclose()
        for events in self.events:
            await events.aclose()


async def open_choices(frontend: Frontend, request_id: str, spec: GenerateSpec) -> Choices:
    """Queue all n choices now, or none: when the coordinator refuses one (ApiError, e.g. a 503 past
    --max-waiting-requests), those already queued are aborted before the error is raised."""
    specs = choice_specs(spec)
    events: list[AsyncGenerator[TokenEvent, None]] = []
    try:
        for rid, one in zip(choice_ids(request_id, len(specs)), specs, strict=True):
            events.append(await settled(frontend.generate(rid, one)))
    except BaseException:
        for ev in events:
            await ev.aclose()
        raise
    return Choices(specs, events, [text_stream(frontend.tokenizer, s, ev) for s, ev in zip(specs, events, strict=True)])


async def interleave(streams: Sequence[AsyncGenerator[TextPiece, None]]
                     ) -> AsyncGenerator[tuple[int, TextPiece], None]:
    """(choice index, piece) in the order the pieces come, until every choice ended. The first error of any
    choice is raised; closing this early (a client gone, an error) closes every choice, which aborts it.

    One choice (n=1, nearly every request) is read directly: a task and a queue between it and the client
    cost a third of the coordinator's time per streamed token."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for piece in only:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[TextPiece, None]) -> None:
        try:
            async with aclosing(stream):
                async for piece in stream:
                    queue.put_nowait((i, piece, None))
        except Exception as exc:  # an ApiError, or a bug: the caller renders it
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, piece, exc = await queue.get()
            if exc is not None:
                raise exc
            if piece is None:
                left -= 1
            else:
                yield i, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(streams: Sequence[AsyncGenerator[TextPiece, None]]) -> list[Completion]:
    """The whole answer of every choice (cancelled, or one choice failing, it aborts them all)."""
    pieces: list[list[TextPiece]] = [[] for _ in streams]
    async with aclosing(interleave(streams)) as merged:
        async for i, piece in merged:
            pieces[i].append(piece)
    return [_joined(p) for p in pieces]
