"""One Step stream of the rank service (rank/service.py): what its three threads hand each other.

The reader thread puts the parsed plans in `inbox`; the step thread takes them in order (`take`, or `peek` to
prepare the next one ahead while the device runs a step) and puts the reports in `outbox`; the handler sends
them. `end` says why the stream must end, once it must.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from lockstep.steps import Plan


class StepStream:
    """One Step stream: the plans its reader thread has received and parsed, the reports its step thread made
    (`outbox`, in plan order, then one of the markers below), and why it must end, if it must."""

    _EOF = object()
    _ABORT = object()  # the stream must end with `end`: the handler aborts (grpc takes an abort only from there)
    _DONE = object()  # the coordinator's side ended and every plan it sent is answered

    def __init__(self, coordinator: str = "", peer: str = "") -> None:
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.next: Any = None  # the inbox's next item, taken out early to be prepared ahead
        self.staged: Plan | None = None  # a plan the engine prepared ahead: started, so it runs whatever comes
        self.end: tuple[grpc.StatusCode, str] | None = None
        self.coordinator, self.peer = coordinator, peer
        self.since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.reading = True  # until its coordinator's side of the RPC ends

    def live(self) -> bool:
        return self.end is None and self.reading

    def take(self) -> Any:
        """The next item in plan order: the one taken out early, if any, else the inbox's next."""
        item, self.next = self.next, None
        return self.inbox.get() if item is None else item

    def peek(self, wait_s: float = 0.0) -> Any:
        """The next item if it arrives within `wait_s`, left in its turn; None if none has."""
        if self.next is None:
            try:
                self.next = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
            except queue.Empty:
                return None
        return self.next

    def stop(self, code: grpc.StatusCode, details: str) -> None:
        self.end = (code, details)
        self.inbox.put(self._EOF)

    def drop(self, why: str) -> None:
        """The RPC is over (or its handler is): stop, unless already told why to."""
        if self.end is None:
            self.stop(grpc.StatusCode.CANCELLED, why)

    def read(self, requests: Iterator[Any], parse: Callable[[Any], Any]) -> None:
        """Each plan read off the wire and parsed here (`parse`, the service's), while the step thread runs the
        step before it (on a GPU host, while the device runs it): the step thread does nothing but steps."""
        try:
            for msg in requests:
                self.inbox.put(parse(msg))
        except Exception:  # the RPC ended (cancelled, aborted, broken): nothing more will arrive
            pass
        finally:
            self.reading = False
            self.inbox.put(self._EOF)
