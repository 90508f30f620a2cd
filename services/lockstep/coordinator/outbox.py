"""One request's undelivered events, from the group's step loop to the request's one client.

asyncio.Queue costs ~12 us a put with its getter and unfinished-task bookkeeping; at batch 256 every decode
step puts 256 events, so the step loop spent a large share of its own time there. An outbox has one consumer
and no bound: a put appends, and wakes the consumer only when it is waiting; a get returns at once (the
coroutine never suspends) while events are there.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    """An unbounded single-consumer FIFO between the event loop's producer and one awaiting consumer."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        """Never blocks; wakes the consumer only if it waits (a put while it has events to read costs no wakeup)."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a consumer cancelled while waiting left its future behind
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> T:
        """The oldest event, waiting for one only when there is none. One consumer: a second caller waiting
        at the same time would take the first one's wakeup."""
        items = self._items
        while not items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return items.popleft()
