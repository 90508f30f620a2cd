"""A second Ctrl-C / SIGTERM stops the coordinator's run at once (exit status 130), wherever the run is when it
comes, and leaves nothing running or listening behind. Run in this process: the coordinator and its servers are
stand-ins, and the signals (SIGTERM, handled like SIGINT) go to this process while `run` handles them."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import tempfile
from pathlib import Path

import grpc
from aiohttp import web

from lockstep.coordinator import main
from lockstep.coordinator.api_workers import ApiWorkers
from lockstep.coordinator.config import CoordinatorConfig, parse_config
from lockstep.coordinator.openai_api import run_app
from lockstep.local_group import free_port


def _signal() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # handled at the loop's next turn: two sent here land in the same turn


class _Coordinator:
    """What `run` asks of the coordinator; `on_wait` runs as the serve wait begins."""

    def __init__(self, on_wait=lambda: None) -> None:
        self.group_up_listeners: list = []
        self.on_wait = on_wait

    def start(self) -> None:
        pass

    async def wait_ready(self) -> None:  # no group ever comes up
        self.on_wait()
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass

    def end_streams(self, why: str) -> None:
        pass


async def _grpc_server(ports: list[int]) -> grpc.aio.Server:
    server = grpc.aio.server()
    ports.append(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    return server


def _run(monkeypatch, config: CoordinatorConfig, coord: _Coordinator, listen, **kwargs) -> tuple[int, list[int]]:
    """`run`'s exit status, and which of the ports `listen` opened (it notes them in its first argument) still
    listen as `run` returns (its loop still runs then: what it left is not yet collected)."""
    ports: list[int] = []

    async def go() -> tuple[int, list[int]]:
        code = await main.run(config, progress=lambda msg: None, **kwargs)
        return code, [p for p in ports if _listening(p)]

    monkeypatch.setattr(main, "build", lambda config, progress: coord)
    monkeypatch.setattr(main, "_listen", lambda *args: listen(ports, *args))
    return asyncio.run(go())


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_two_signals_in_one_turn_of_the_loop_stop_the_frontends_link_too(monkeypatch, tmp_path: Path):
    """Two SIGTERMs at once (or a second Ctrl-C before the stop's cleanup began): the run was cancelled before
    ApiWorkers.cleanup ran, and the frontends' link server was left to grpc's collection after the loop closed:
    'Exception ignored in Server.__del__ ... Event loop is closed' and "coroutine 'AioServer.shutdown' was
    never awaited" at the exit."""
    config = parse_config(["--group", "g0=127.0.0.1:1", "--model", str(tmp_path)])

    async def listen(ports, config, coord, stop, progress):
        link = await _grpc_server(ports)
        workers = ApiWorkers(config, tmp_path, socket.socket(), tempfile.mkdtemp(dir=tmp_path), link, None)
        return await _grpc_server(ports), workers

    assert _run(monkeypatch, config, _Coordinator(on_wait=lambda: (_signal(), _signal())), listen) == (130, [])


def test_two_signals_in_one_turn_of_the_loop_close_the_http_port(monkeypatch, tmp_path: Path):
    """The same without frontends: the HTTP port was left listening (in `lockstep serve`, while its ranks stop, up
    to 10 s more) with nothing to answer what it took."""
    config = parse_config(["--group", "g0=127.0.0.1:1", "--model", str(tmp_path)])

    async def listen(ports, config, coord, stop, progress):
        grpc_server, port = await _grpc_server(ports), free_port()
        ports.append(port)
        return grpc_server, await run_app(web.Application(), "127.0.0.1", port, config.shutdown_grace)

    assert _run(monkeypatch, config, _Coordinator(on_wait=lambda: (_signal(), _signal())), listen) == (130, [])


def test_a_second_signal_while_the_servers_start_closes_the_supervisor_that_never_ran(monkeypatch, tmp_path: Path):
    """The first signal while the API frontends start (`_listen`: their start is cancelled and cleans up after
    itself), the second before that ended: `run` returned 130, and `lockstep serve`'s supervisor coroutine,
    never started, was left unclosed: "RuntimeWarning: coroutine 'supervise_all' was never awaited" at the exit.
    The same for a port in use, and for a stop while the frontends start."""
    config = parse_config(["--group", "g0=127.0.0.1:1", "--model", str(tmp_path)])

    async def listen(ports, config, coord, stop, progress):
        _signal()
        await stop.wait()
        _signal()
        await asyncio.sleep(60)  # the frontends' start ending, given STOP_SLACK_S: the second signal cuts it
        raise AssertionError("not reached")

    async def supervise() -> None:
        raise AssertionError("not reached")

    supervisor = supervise()
    assert _run(monkeypatch, config, _Coordinator(), listen, supervise=supervisor) == (130, [])
    assert inspect.getcoroutinestate(supervisor) == inspect.CORO_CLOSED


def test_a_second_signal_while_the_groups_file_watch_ends_is_not_taken_for_its_end(monkeypatch, tmp_path: Path):
    """With a groups file, the stop cancels its watch and waits for it to end (it may be moving a removed group's
    requests); a second signal then cancelled that wait, and `contextlib.suppress(CancelledError)` took it for the
    watch's own end: the run stopped through its whole grace and exited 0, its signal handlers gone."""
    groups = tmp_path / "groups"
    groups.write_text("g0=127.0.0.1:1\n")
    config = parse_config(["--groups-file", str(groups), "--model", str(tmp_path)])

    class Runner:  # the HTTP API's
        sites = ()

        async def cleanup(self) -> None:
            pass

    async def listen(ports, config, coord, stop, progress):
        return await _grpc_server(ports), Runner()

    async def watch(coord, path) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # the stop's: it ends once a change being applied is
            _signal()
            await asyncio.Event().wait()

    monkeypatch.setattr(main, "watch_groups_file", watch)
    assert _run(monkeypatch, config, _Coordinator(on_wait=_signal), listen) == (130, [])
