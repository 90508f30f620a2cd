"""`lockstep coordinator`: connect to every rank of every group, then serve HTTP, gRPC and /metrics."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
from aiohttp import web

from lockstep.coordinator.api_workers import AT_ONCE, ApiWorkers
from lockstep.coordinator.config import CoordinatorConfig, parse_config
from lockstep.coordinator.group_list import parse_group_list
from lockstep.coordinator.grpc_api import start_grpc
from lockstep.coordinator.loop_watchdog import LoopWatchdog
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.service import Coordinator
from lockstep.coordinator.stopping import (
    STOP_SLACK_S,
    abandon,
    bounded,
    dump_on_sigusr1,
    errors_exit,
    exit_status,
    run_to_end,
)
from lockstep.model.config import ModelConfig
from lockstep.tokenizer import Tokenizer

GROUPS_POLL_S = 2.0
T = TypeVar("T")
log = logging.getLogger("lockstep.coordinator")


def resolve_model(model: str, progress: Callable[[str], None]) -> Path:
    """--model as a directory: 'builtin' and 'builtin:NAME' are fetched and imported on first use."""
    if model.startswith("builtin"):
        from lockstep.model.builtin import resolve_model as resolve_builtin

        return resolve_builtin(model, progress=progress)
    return Path(model)


def model_name(model_dir: Path, model: ModelConfig, given: str) -> str:
    """The name clients use: --served-model-name, else the checkpoint's own name, else its directory's."""
    if given:
        return given
    name = model.name_or_path
    return Path(name).name if name and not name.startswith("/") else model_dir.name


async def watch_groups_file(coord: Coordinator, path: Path, interval: float = GROUPS_POLL_S) -> None:
    """Apply the groups file whenever its text changes. Its content is compared, not its mtime: the kubelet
    updates a mounted ConfigMap by swapping a symlink. A file that cannot be read or parsed, or that lists
    no group, changes nothing (logged once per new text or error), so a half-written file never removes a
    group; the coordinator keeps serving the groups it has."""
    last: str | None = None
    while True:
        await asyncio.sleep(interval)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            text = f"\0{exc}"  # compared like a text, so the same error is logged once
            if text != last:
                log.error("cannot read the groups file %s (%s); keeping groups %s", path, exc, sorted(coord.groups))
            last = text
            continue
        if text == last:
            continue
        last = text
        try:
            listed = parse_group_list(text)
        except ValueError as exc:
            log.error("the groups file %s is not valid (%s); keeping groups %s", path, exc, sorted(coord.groups))
            continue
        if not listed:
            log.error("the groups file %s lists no group; keeping groups %s", path, sorted(coord.groups))
            continue
        try:
            if await coord.apply_groups(listed):
                log.info("groups file %s applied: now serving groups %s", path, sorted(coord.groups))
        except Exception:  # a bug here must not stop the watch: the next change is still applied
            log.exception("applying the groups file %s failed; serving groups %s", path, sorted(coord.groups))


def build(config: CoordinatorConfig, progress: Callable[[str], None]) -> Coordinator:
    model_dir = resolve_model(config.model, progress)
    model = ModelConfig.from_dir(model_dir)
    return Coordinator(config, Tokenizer.from_dir(model_dir).for_model(model.vocab_size),
                       model_name(model_dir, model, config.served_model_name),
                       model.max_position_embeddings)


async def run(
    config: CoordinatorConfig,
    on_ready: Callable[[], None] | None = None,
    supervise: Coroutine[Any, Any, None] | None = None,
    progress: Callable[[str], None] = print,
    on_group_up: Callable[[str], None] | None = None,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    coord = build(config, progress)
    if on_group_up is not None:
        coord.group_up_listeners.append(on_group_up)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal() -> None:
        """The first Ctrl-C / SIGTERM stops gracefully. A second stops at once: it cancels the run, whose clean-ups
        still run (a KeyboardInterrupt raised wherever the loop was, inside grpc's poller, left grpc to crash as
        its servers stopped); a third is Python's own."""
        if stop.is_set():
            for s in signals:
                loop.remove_signal_handler(s)
            if main is not None:
                main.cancel(AT_ONCE)
            return
        progress(f"stopping: requests in flight have {config.shutdown_grace:g} s to finish (again to stop now)")
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    try:
        return await _run(config, coord, stop, supervise, on_ready, progress)
    except asyncio.CancelledError as exc:
        if exc.args != (AT_ONCE,):
            raise
        return 130  # as for a KeyboardInterrupt
    finally:  # however the run ended before it served (a port in use, a stop or a second Ctrl-C while it started)
        if supervise is not None and inspect.getcoroutinestate(supervise) == inspect.CORO_CREATED:
            supervise.close()  # never started: not "coroutine ... was never awaited" at the exit


async def _run(config: CoordinatorConfig, coord: Coordinator, stop: asyncio.Event,
               supervise: Coroutine[Any, Any, None] | None, on_ready: Callable[[], None] | None,
               progress: Callable[[str], None]) -> int:
    """Start, serve until a stop or until `supervise` ends, then stop in order (the exit status)."""
    grace = config.shutdown_grace
    progress(f"waiting for {sum(len(a) for a in config.groups.values())} rank(s) to load the model and form "
             f"their group(s)")
    coord.start()
    try:
        grpc_server, runner = await _listen(config, coord, stop, progress)
    except OSError as exc:  # a port in use, or an address not this machine's: one line, not a traceback
        progress(f"cannot serve: {exc}")
        await bounded(coord.close(), STOP_SLACK_S, "the groups to close")
        return 1
    if runner is None:  # the stop came while the frontends started: they are killed, the rest stops as after serving
        await _stop_servers(coord, grace, grpc_server.stop(grace))
        return 0
    watchdog = LoopWatchdog(config.watchdog_timeout) if config.watchdog_timeout else None
    if watchdog is not None:  # from here on the loop only serves: nothing may hold it for long
        watchdog.start(asyncio.get_running_loop())
    try:
        return await _serve(config, coord, runner, grpc_server, stop, supervise, on_ready, progress)
    except asyncio.CancelledError:  # a second Ctrl-C: what still runs is stopped now, as asked, and is no error
        await _stop_now(grpc_server, runner)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if isinstance(runner, ApiWorkers):
            runner.close_now()  # whatever stopped the run: no frontend and no link directory outlives it


async def _listen(config: CoordinatorConfig, coord: Coordinator, stop: asyncio.Event, progress: Callable[[str], None]
                  ) -> tuple[grpc.aio.Server, web.AppRunner | ApiWorkers | None]:
    """The gRPC server and the HTTP API (None: the stop came while its frontends started); OSError where either
    cannot bind, the other stopped."""
    grpc_server = await start_grpc(coord, config.host, config.grpc_port, config.api_keys)
    try:
        if not config.api_workers:
            app = OpenAIServer(coord, config.api_keys).app()
            return grpc_server, await run_app(app, config.host, config.http_port, config.shutdown_grace,
                                              keep_alive=config.http_keep_alive)
        workers = await _unless_stopped(ApiWorkers.start(coord, config, resolve_model(config.model, progress)), stop)
    except BaseException:
        await grpc_server.stop(0)
        raise
    if workers is not None:
        progress(f"the HTTP API runs in {config.api_workers} frontend process(es)")
    return grpc_server, workers


async def _serve(config: CoordinatorConfig, coord: Coordinator, runner: web.AppRunner | ApiWorkers,
                 grpc_server: grpc.aio.Server, stop: asyncio.Event, supervise: Coroutine[Any, Any, None] | None,
                 on_ready: Callable[[], None] | None, progress: Callable[[str], None]) -> int:
    """Serve until a stop (0) or until `supervise` ends (1), then stop in order within the grace."""
    loop = asyncio.get_running_loop()
    grace = config.shutdown_grace
    if not config.api_keys:
        progress("no API key set (--api-key / LOCKSTEP_API_KEY): /v1/* and /admin/* are open to anyone who "
                 "reaches the port")
    regroup = loop.create_task(watch_groups_file(coord, Path(config.groups_file))) if config.groups_file else None
    ready = loop.create_task(coord.wait_ready())
    waiter = loop.create_task(stop.wait())
    watcher = loop.create_task(supervise if supervise is not None else asyncio.Event().wait())
    done, _ = await asyncio.wait({ready, waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        if on_ready:
            on_ready()
        else:
            progress(f"serving http://{config.host}:{config.http_port}/v1 (gRPC on {config.grpc_port})")
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    else:
        ready.cancel()
    code = 0 if waiter in done else 1
    if regroup is not None:
        await _cancelled(regroup)
    await _stop_servers(coord, grace, grpc_server.stop(grace), runner.cleanup())
    return code


async def _stop_now(grpc_server: grpc.aio.Server, runner: web.AppRunner | ApiWorkers) -> None:
    """Told to stop at once: every server stops listening now, whether or not the stop's cleanup began (two
    signals in one turn of the loop cancel the run before it did)."""
    await grpc_server.stop(0)  # here, not when grpc collects it after the loop has closed
    if isinstance(runner, ApiWorkers):
        await runner.stop_now(AT_ONCE)  # the frontends, and then their link
        return
    for site in list(runner.sites):  # closes its listening socket: no connection waits on a port nobody serves
        await site.stop()


async def _stop_servers(coord: Coordinator, grace: float, *stops: Awaitable[Any]) -> None:
    """Stop the servers (`stops`) and then the groups, each within its bound (docs/runbook.md)."""
    # the servers stop taking requests now; the groups keep stepping for the streams in their grace, and the
    # streams still open after it end with an error event: aiohttp cuts a handler only after twice its
    # shutdown timeout, and a streaming one was seen to run to its end (test_shutdown)
    stopping = asyncio.ensure_future(asyncio.gather(*stops))
    try:
        waited = await asyncio.wait({stopping}, timeout=grace)
    except asyncio.CancelledError:  # a second Ctrl-C during the grace: they stop now, and finish their clean-ups
        stopping.cancel()
        await asyncio.wait({stopping}, timeout=STOP_SLACK_S)
        abandon(stopping)
        raise
    if not waited[0]:
        coord.end_streams(f"the server is shutting down: requests in flight had {grace:g} s to finish")
    # past this, whatever still waits is a bug: it is logged with every task's stack, and the stop goes on
    await bounded(stopping, max(grace, STOP_SLACK_S), "the HTTP and gRPC servers to stop")
    await bounded(coord.close(), STOP_SLACK_S, "the groups to close")


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel `task` and wait for its end (raising its error, if it failed). Not `await task` with its
    CancelledError suppressed: a second Ctrl-C while it ends cancels the caller, and that would be taken for the
    task's own and swallowed, the stop going on through its whole grace."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.result()


async def _unless_stopped(start: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """What `start` returns; or None once `stop` is set first, `start` cancelled (and given STOP_SLACK_S to clean
    up after itself): the API frontends have START_TIMEOUT_S to link, which must not hold up a SIGTERM."""
    task = asyncio.ensure_future(start)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await bounded(asyncio.wait({task}), STOP_SLACK_S, "the start to end once cancelled")
    return None


def main(argv: list[str] | None = None) -> int:
    dump_on_sigusr1()  # from the first moment: loading the tokenizer may be where it waits
    config = parse_config(argv)
    with errors_exit():  # a failed start or a second Ctrl-C must not wait on an executor thread for ever either
        code = run_to_end(run(config))
    return exit_status(code)
