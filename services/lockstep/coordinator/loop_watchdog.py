"""The coordinator's event-loop watchdog: a loop that stops turning ends the process, with every thread's stack.

The coordinator's HTTP API, its groups' step loops and its gRPC servers share one asyncio loop. A loop that stops
turning (a blocking call on it, a lock that is never released) leaves a process that looks alive: the kernel still
completes TCP connections on its ports (a `tcpSocket` liveness probe passes), and gRPC's own threads still answer
the ranks' keepalive pings, so the ranks stay bound to it and refuse any other coordinator. No request is served
again until someone notices. SGLang's `--watchdog-timeout` ends its scheduler for the same reason.

A callback on the loop stamps the time every tick; a thread of its own checks the stamp. Past the timeout it
writes every thread's stack to stderr and exits with status 1, and whatever supervises the coordinator (the
kubelet, `lockstep serve`'s caller) starts it again. A pause of the whole process (SIGSTOP, Ctrl-Z, a frozen VM)
stops the watching thread too: it sees its own sleep overrun and gives the loop a fresh timeout, so `fg` after
a long Ctrl-Z does not end it. A C call that holds the GIL for ever stops the watching thread as well; that
hang is not caught here. What the end writes may block (a handler's lock that the stalled loop holds, a full
pipe on stderr), so it is given END_WITHIN_S: past that the process ends without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the loop stamps the time and the thread looks at it
PAUSED_AFTER_S = 3.0  # the thread's own sleep overran by this many ticks: the whole process was paused
LOG_WITHIN_S = 2.0  # how long the CRITICAL line may take before the stacks are written without it
END_WITHIN_S = 10.0  # past this the process ends, whatever the line or the stacks still wait on


class LoopWatchdog:
    """Ends the process when the loop has not stamped the time for `timeout_s` while the watcher ran. A stamp
    later than `lag_warning_s` past its tick is logged, so a loop that stalls for less is seen too."""

    def __init__(self, timeout_s: float, tick_s: float = TICK_S, lag_warning_s: float = 1.0) -> None:
        if not timeout_s > tick_s:
            raise ValueError(f"the watchdog's timeout ({timeout_s:g} s) must be longer than its tick ({tick_s:g} s)")
        self.timeout_s, self.tick_s, self.lag_warning_s = timeout_s, tick_s, lag_warning_s
        self._handle: asyncio.TimerHandle | None = None
        self._stamp = 0.0
        self._seen = 0.0  # when the watching thread last ran
        self._stop = threading.Event()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        log.info("event-loop watchdog: the coordinator ends, with every thread's stack on stderr, if its event "
                 "loop stalls for %g s (--watchdog-timeout)", self.timeout_s)
        self._stamp = self._seen = time.monotonic()
        self._handle = loop.call_later(self.tick_s, self._tick, loop)
        threading.Thread(target=self._watch, daemon=True, name="loop-watchdog").start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        stalled = now - self._stamp
        if stalled > self.tick_s + self.lag_warning_s:
            if now - self._seen > PAUSED_AFTER_S * self.tick_s:  # the watching thread did not run either
                log.info("the whole process did not run for %.1f s (paused: SIGSTOP, Ctrl-Z), which the watchdog "
                         "does not count as a stall", stalled)
            else:
                log.warning("the event loop stalled for %.1f s (a blocking call on it?); the watchdog ends the "
                            "coordinator at %g s", stalled, self.timeout_s)
        self._stamp = now
        self._handle = loop.call_later(self.tick_s, self._tick, loop)

    def _watch(self) -> None:
        seen = time.monotonic()
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            if now - seen > PAUSED_AFTER_S * self.tick_s:  # this thread did not run either: not the loop's doing
                self._stamp = max(self._stamp, now)
            seen = self._seen = now
            if now - self._stamp > self.timeout_s and not self._stop.is_set():
                self._end(now - self._stamp)

    def _end(self, stalled: float) -> None:
        # the loop's thread may be stalled inside a logging handler, holding its lock (a write to a pipe that
        # nobody reads), and then log.critical here would wait as long: the line gets its own thread and
        # LOG_WITHIN_S, and whatever still blocks after END_WITHIN_S (stderr itself) does not keep the process
        ender = threading.Timer(END_WITHIN_S, os._exit, (1,))
        ender.daemon = True
        ender.start()
        said = threading.Thread(target=self._say, args=(stalled,), daemon=True, name="loop-watchdog-log")
        said.start()
        said.join(LOG_WITHIN_S)
        if said.is_alive():  # straight to the file descriptor: sys.stderr's own lock may be held as well
            with contextlib.suppress(OSError):
                os.write(2, f"CRITICAL the event loop has not turned for {stalled:.0f} s (--watchdog-timeout "
                            f"{self.timeout_s:g}) and logging blocks: ending the coordinator; every thread's "
                            f"stack follows\n".encode())
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, OSError, ValueError):  # stderr is no file: the stacks go through logging
            stacks = (f"thread {t}:\n{''.join(traceback.format_stack(f))}" for t, f in sys._current_frames().items())
            log.critical("stacks:\n%s", "\n".join(stacks))
        sys.stderr.flush()
        os._exit(1)

    def _say(self, stalled: float) -> None:
        log.critical("the event loop has not turned for %.0f s (--watchdog-timeout %g): ending the coordinator so "
                     "that it is started again; every thread's stack follows on stderr (the loop's runs "
                     "run_forever)", stalled, self.timeout_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
