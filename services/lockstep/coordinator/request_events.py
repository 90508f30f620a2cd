"""A request's events between the coordinator's step loop and whoever serves its client.

The step loop puts every event into the request's `EventSink` without waiting: an `Outbox` that an HTTP or gRPC
handler in the coordinator's process reads through `RequestEvents`, or a frontend link's queue
(frontend_link.py) that batches a step's events for an API frontend process.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from lockstep.coordinator.generation import TokenEvent
from lockstep.coordinator.outbox import Outbox
from lockstep.steps import TokenLogprobs

T = TypeVar("T")


async def settled(answer: T | Awaitable[T]) -> T:
    """A frontend's answer: as it is in process, awaited when it comes over the link."""
    return await answer if inspect.isawaitable(answer) else answer


def token_out(token_id: int, cached_tokens: int, logprobs: TokenLogprobs | None,
              prompt_logprobs: Sequence[TokenLogprobs] | None) -> TokenEvent:
    """A token for its client. Built with positional arguments, in TokenEvent's field order (generation.py; the
    dispatch builds one per running request each step, and keywords cost more: 0.26 against 0.14 us)."""
    return TokenEvent(token_id, None, cached_tokens, "", 503, logprobs, prompt_logprobs)


class EventSink(Protocol):
    """Where a request's events go: put never blocks (the step loop calls it for every token)."""

    def put(self, item: TokenEvent) -> None: ...


class Ending(Protocol):
    """Whoever holds the request (the coordinator, or an API frontend's link to it), as its reader ends it."""

    def _end(self, request_id: str, finished: bool, stopped: bool = False) -> None: ...


class RequestEvents:
    """One request's events for its client. Closing it early (even before the first event: a client gone
    between `generate` and its first read) aborts the request and frees its pages; an async generator
    would skip its cleanup when closed before it started."""

    def __init__(self, coordinator: Ending, request_id: str, queue: Outbox[TokenEvent]) -> None:
        self._coordinator = coordinator
        self._request_id = request_id
        self._queue = queue
        self._done = False
        self._stopped = False

    def __aiter__(self) -> RequestEvents:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            ev: TokenEvent = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if ev.finish_reason is not None or ev.error:
            self._done = True
            self._coordinator._end(self._request_id, finished=True)
        return ev

    def stopped(self) -> None:
        """The reader ends the request at a stop string: closing it still aborts it (its group would generate on),
        but it counts as finished, not as a client gone."""
        self._stopped = True

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._coordinator._end(self._request_id, finished=False, stopped=self._stopped)
