"""How the coordinator's process stops: within bounds, and saying where it waits when it does not.

A stop that hangs is the worst way for a server to fail: the pod sits in Terminating, the client's stream
never ends, nothing says why. So every stage of the stop gets a time (`bounded`), the event loop's own end
and its executor's threads too (`run_to_end`, `exit_status`), and what overruns is logged with the chain of
awaits each asyncio task sits in, or the stack of each thread; the same log is one `kill -USR1 <pid>` away at
any moment of the process's life (`dump_on_sigusr1`), also before its event loop runs or after it closed,
when it shows the main thread's stack instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("lockstep.coordinator")

STOP_SLACK_S = 5.0  # how long a stage of the stop may take past the grace before what hangs is logged and left
EXECUTOR_THREADS = "lockstep-executor"  # the name of run_to_end's default executor's threads, then _0, _1, ...


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
        abandon(task)
        raise
    if done:
        task.result()
        return
    log.error("waited %g s for %s; going on without them. Where every task waits:", timeout, what)
    log_tasks()
    abandon(task)


def abandon(task: asyncio.Future) -> None:
    """Cancel `task`, and take its end when it comes: nobody awaits it any more, and asyncio would log the error
    of a future never retrieved (a gather's CancelledError, with the traceback of whatever interrupted)."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def run_to_end(main: Coroutine[Any, Any, int], timeout: float = STOP_SLACK_S) -> int:
    """`asyncio.run`, except that the tasks left when `main` returns get `timeout` s to end once cancelled, and
    so do the async generators left open and, at the same time, the default executor's threads: asyncio.run
    waits for all of them without limit, so one that ignores its cancellation, or a call that blocks for ever in
    the executor, would keep the process up after it was told to stop (logged, with where they wait). What
    asyncio.run reports of them, an error a left task ended with, is logged too. A thread cannot be stopped: the
    process exits without it (`exit_status`)."""
    loop = asyncio.new_event_loop()
    executor = ThreadPoolExecutor(thread_name_prefix=EXECUTOR_THREADS)  # named, so its threads can be found
    loop.set_default_executor(executor)
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
            loop.run_until_complete(asyncio.gather(
                bounded(loop.shutdown_asyncgens(), timeout, "async generators to close"),
                _executor_ended(executor, timeout)))
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def executor_threads() -> list[threading.Thread]:
    """The threads of run_to_end's default executor still running."""
    return [t for t in threading.enumerate() if t.name.startswith(EXECUTOR_THREADS + "_") and t.is_alive()]


async def _executor_ended(executor: ThreadPoolExecutor, timeout: float) -> None:
    """Let the idle threads go and wait `timeout` s for those still in a call; log where those left wait.
    (loop.shutdown_default_executor has no timeout before Python 3.12, and its thread would wait on.)"""
    executor.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + timeout
    while (left := executor_threads()) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if left:
        log.error("waited %g s for %d executor thread(s) to end; going on without them. Where each waits:",
                  timeout, len(left))
        log_threads(left)


def log_threads(threads: list[threading.Thread]) -> None:
    """Log each thread's stack."""
    frames = sys._current_frames()
    for t in threads:
        frame = frames.get(t.ident) if t.ident is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no Python frame)\n"
        log.warning("thread %s is at\n%s", t.name, stack.rstrip())


def exit_status(code: int) -> int:
    """`code`, for the caller to exit with; but with an executor thread still running, the process exits here,
    with `code`: the interpreter's exit joins every executor thread, and one in a call that never ends would
    keep the process up for ever (run_to_end logged where it waits)."""
    left = executor_threads()
    if not left:
        return code
    log.error("exiting with status %d without %d executor thread(s) still running: %s", code, len(left),
              ", ".join(t.name for t in left))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


@contextlib.contextmanager
def errors_exit() -> Iterator[None]:
    """An error (or a second Ctrl-C) out of the block, with an executor thread still running, is printed and the
    process exits here (status 1; 130 for Ctrl-C), as `exit_status` does: raised on, the interpreter's exit would
    join that thread for ever. Without one left, the error is raised as it is."""
    try:
        yield
    except BaseException as exc:
        if not executor_threads() or isinstance(exc, SystemExit):
            raise
        traceback.print_exception(exc)
        exit_status(130 if isinstance(exc, KeyboardInterrupt) else 1)


async def _log_errors(tasks: set[asyncio.Task]) -> None:
    for task, result in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
        if isinstance(result, Exception):
            log.error("task %s, left at the end, failed", task.get_name(), exc_info=result)
