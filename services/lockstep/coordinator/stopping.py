"""How the coordinator's process stops: within bounds, and saying where it waits when it does not.

A stop that hangs is the worst way for a server to fail: the pod sits in Terminating, the client's stream
never ends, nothing says why. So every stage of the stop gets a time (`bounded`), the event loop's own end
too (`run_to_end`), and what overruns is logged with the chain of awaits each asyncio task sits in; the same
log is one `kill -USR1 <pid>` away at any moment of the process's life (`dump_on_sigusr1`), also before its
event loop runs or after it closed, when it shows the main thread's stack instead.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import traceback
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("lockstep.coordinator")

STOP_SLACK_S = 5.0  # how long a stage of the stop may take past the grace before what hangs is logged and left


def _first(obj: object, *names: str) -> Any:
    return next((getattr(obj, n) for n in names if getattr(obj, n, None) is not None), None)


def log_tasks(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Log where every asyncio task of `loop` (the running one by default) waits, each coroutine down its
    await chain."""
    for task in asyncio.all_tasks(loop):
        where, coro = [], task.get_coro()
        while coro is not None and len(where) < 30:
            if (frame := _first(coro, "cr_frame", "ag_frame", "gi_frame")) is not None:
                where.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
            coro = _first(coro, "cr_await", "ag_await", "gi_yieldfrom")
        log.warning("task %s: %s", task.get_name(), " > ".join(where) or "not started")


def dump_on_sigusr1() -> None:
    """From now until the process exits, SIGUSR1 logs the main thread's stack and, while an event loop runs,
    every task's await chain; nothing else happens (SIGUSR1's default would end the process)."""

    def dump(signum: int, frame: FrameType | None) -> None:
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no Python frame)\n"
        log.warning("SIGUSR1: the main thread is at\n%s", stack.rstrip())
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            log.warning("SIGUSR1: no event loop runs now")
            return
        log_tasks()

    signal.signal(signal.SIGUSR1, dump)


async def bounded(work: Awaitable[Any], timeout: float, what: str) -> None:
    """Wait for `work` at most `timeout` s; past it, log where every task waits and cancel it without waiting
    (a task that ignores its cancellation must not hold the stop up). Its error, if it failed, is raised; a
    cancelled caller cancels it too."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        task.result()
        return
    log.error("waited %g s for %s; going on without them. Where every task waits:", timeout, what)
    log_tasks()
    task.cancel()


def run_to_end(main: Coroutine[Any, Any, int], timeout: float = STOP_SLACK_S) -> int:
    """`asyncio.run`, except that the tasks left when `main` returns get `timeout` s to end once cancelled, and
    so do the async generators left open: asyncio.run waits for both without limit, so one that ignores its
    cancellation would keep the process up after it was told to stop (logged, with where they wait). What
    asyncio.run reports of them, an error a left task ended with, is logged too. Executor threads are joined
    as asyncio.run joins them (a thread cannot be stopped; ours, a group's rank stop, ends by itself)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(bounded(_log_errors(left), timeout,
                                                f"{len(left)} task(s) left at the end to finish"))
            loop.run_until_complete(bounded(loop.shutdown_asyncgens(), timeout, "async generators to close"))
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _log_errors(tasks: set[asyncio.Task]) -> None:
    for task, result in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
        if isinstance(result, Exception):
            log.error("task %s, left at the end, failed", task.get_name(), exc_info=result)
