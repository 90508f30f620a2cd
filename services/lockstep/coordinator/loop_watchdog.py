"""The coordinator's event-loop watchdog: a loop that stops turning ends the process, with every thread's stack.

The coordinator's HTTP API, its groups' step loops and its gRPC servers share one asyncio loop. A loop that stops
turning (a blocking call on it, a C call that never returns) leaves a process that looks alive: the kernel still
completes TCP connections on its ports (a `tcpSocket` liveness probe passes), and gRPC's own threads still answer
the ranks' keepalive pings, so the ranks stay bound to it and refuse any other coordinator. No request is served
again until someone notices. SGLang's `--watchdog-timeout` ends its scheduler for the same reason.

The timer is faulthandler's: it runs on its own C thread and needs no GIL, so it fires even while the loop's
thread holds the GIL inside a C call; it writes every thread's stack to stderr ("Timeout (h:mm:ss)!") and exits
with status 1, and whatever supervises the coordinator (the kubelet, `lockstep serve`'s caller) starts it again.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import time

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the loop re-arms the timer


class LoopWatchdog:
    """Re-armed by a callback on the loop every `tick_s`; `timeout_s` without one ends the process. A tick that
    comes late by more than `lag_warning_s` is logged, so a loop that stalls for less than the timeout is seen too."""

    def __init__(self, timeout_s: float, tick_s: float = TICK_S, lag_warning_s: float = 1.0) -> None:
        if not timeout_s > tick_s:
            raise ValueError(f"the watchdog's timeout ({timeout_s:g} s) must be longer than its tick ({tick_s:g} s)")
        self.timeout_s, self.tick_s, self.lag_warning_s = timeout_s, tick_s, lag_warning_s
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arm the timer; a process whose stderr is not a file (none to write the stacks to) runs without it."""
        try:
            sys.stderr.fileno()
        except (AttributeError, OSError, ValueError) as exc:
            log.warning("event-loop watchdog off: stderr is not a file the stacks could go to (%s)", exc)
            return
        log.info("event-loop watchdog: the coordinator ends, with every thread's stack on stderr, if its event "
                 "loop stalls for %g s (--watchdog-timeout)", self.timeout_s)
        self._due = time.monotonic()
        self._tick(loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        late = now - self._due
        if late > self.lag_warning_s:
            log.warning("the event loop stalled for %.1f s (a blocking call on it?); the watchdog ends the "
                        "coordinator at %g s", late + self.tick_s, self.timeout_s)
        faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=sys.stderr)
        self._due = now + self.tick_s
        self._handle = loop.call_later(self.tick_s, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            faulthandler.cancel_dump_traceback_later()
