"""`--api-workers N`: the HTTP API in N frontend processes (remote.py) instead of the coordinator's own loop.

At large batch the coordinator's time per streamed token (detokenizing, stop strings, the SSE chunk's JSON,
the socket write: 35-63 us, 9-16 ms per step at batch 256, scripts/bench_stream_frontend.py) is several times
its scheduling. vLLM splits the same way (`--api-server-count`). The coordinator reserves the HTTP port (a port
in use fails the start, as without frontends); N processes listen on it (SO_REUSEPORT) and each gets one message
per step from the coordinator over the link. The coordinator then serves only
gRPC itself; /health, /metrics and /admin are answered by the frontends from the coordinator's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.frontend_link import FrontendLinkServicer, Link, start_link
from lockstep.coordinator.service import Coordinator
from lockstep.rank_auth import TOKEN_ENV, TOKEN_FILE_ENV

log = logging.getLogger("lockstep.api_workers")
START_TIMEOUT_S = 120.0  # for every frontend to import, load the tokenizer and open its link
RESTART_BACKOFF_S = (1.0, 30.0)  # a frontend that exits is started again after this long, doubling up to the cap
STEADY_S = 10.0  # a frontend that ran this long before it exited starts again after the shortest wait
KILL_AFTER_GRACE_S = 2.5  # past its shutdown grace a frontend is killed (inside the coordinator's own stop bound)
KILL_WAIT_S = 1.0  # for a killed frontend to be gone
POLL_S = 0.2
# A frontend that sent no heartbeat for this long (remote.FRONTEND_BEAT_S apart) is stopped or its event loop is
# stuck: it is killed and started again. Alive, it keeps its share of the shared port, and the kernel goes on
# handing it connections that nobody answers.
FRONTEND_SILENT_S = 10.0


AT_ONCE = "was still serving when told to stop at once"  # why a frontend killed on a second Ctrl-C is no fault


def reserve(host: str, port: int) -> socket.socket:
    """The HTTP port, held for the frontends: bound with SO_REUSEPORT but never listening, so it takes no
    connection itself, a port in use is an error at once, and no process without SO_REUSEPORT (of another
    user: none at all) can take the port while the frontends restart. The frontends bind it with SO_REUSEPORT
    too, and the kernel spreads the connections over them (one shared listening socket let the first frontend
    to wake accept a whole burst: 100% of 256 connections in one of two)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(info[4])
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def frontend_env(parent: Mapping[str, str], api_keys: Sequence[str]) -> dict[str, str]:
    """A frontend's environment: the API keys (by environment, never on a command line), and not the ranks'
    group token, which a frontend never uses (it talks only to this coordinator)."""
    env = {k: v for k, v in parent.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env["LOCKSTEP_API_KEY"] = ",".join(api_keys)
    return env


class ApiWorkers:
    """The frontend processes, the port they serve and the link they hold; `cleanup` stops them all, as
    an HTTP runner's would."""

    def __init__(self, config: CoordinatorConfig, model_dir: Path, sock: socket.socket, link_dir: str,
                 server: grpc.aio.Server, servicer: FrontendLinkServicer) -> None:
        self.config, self.model_dir, self.sock, self.link_dir = config, model_dir, sock, link_dir
        self.server, self.servicer = server, servicer
        self.address = f"unix:{link_dir}/link.sock"
        self.procs: list[subprocess.Popen] = []
        self.started: list[float] = []
        self._stopping = False
        self._watch: asyncio.Task | None = None

    @classmethod
    async def start(cls, coordinator: Coordinator, config: CoordinatorConfig, model_dir: Path) -> ApiWorkers:
        """Bind the port, open the link and start the frontends; return once each has linked, or raise (closing
        everything) if one exits first or they take longer than START_TIMEOUT_S."""
        sock = reserve(config.host, config.http_port)
        link_dir = tempfile.mkdtemp(prefix="lockstep-link-")  # 0700: only this user reaches the link
        try:
            server, servicer = await start_link(coordinator, f"unix:{link_dir}/link.sock")
        except BaseException:
            sock.close()
            shutil.rmtree(link_dir, ignore_errors=True)
            raise
        workers = cls(config, model_dir, sock, link_dir, server, servicer)
        servicer.on_wedged = workers.kill_wedged
        try:
            for _ in range(config.api_workers):
                workers._spawn(None)
            await workers._until_linked()
        except BaseException as exc:
            # cancelled: the coordinator was told to stop while they started, so killing them is no failure
            workers.close_now("was still starting when the coordinator stopped" if isinstance(
                exc, asyncio.CancelledError) else "")
            await server.stop(0)  # else it serves on, with nothing to stop it
            raise
        workers._watch = asyncio.ensure_future(workers._restart_exited())
        return workers

    def _spawn(self, slot: int | None) -> None:
        c = self.config
        env = frontend_env(os.environ, c.api_keys)
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep.coordinator.remote", "--link", self.address, "--model",
             str(self.model_dir), "--host", c.host, "--port", str(c.http_port), "--shutdown-grace",
             str(c.shutdown_grace), "--timeout-keep-alive", str(c.http_keep_alive)], env=env)
        if slot is None:
            self.procs.append(proc)
            self.started.append(time.monotonic())
        else:
            self.servicer.beats.pop(self.procs[slot].pid, None)
            self.procs[slot], self.started[slot] = proc, time.monotonic()

    def kill_silent(self, now: float) -> None:
        """Kill each frontend that has sent no heartbeat for FRONTEND_SILENT_S (one starting has START_TIMEOUT_S to
        link), so the watch starts it again."""
        for proc, started in zip(self.procs, self.started, strict=True):
            heard = self.servicer.beats.get(proc.pid)
            due = started + START_TIMEOUT_S if heard is None or heard < started else heard + FRONTEND_SILENT_S
            if now > due and proc.poll() is None:
                log.error("API frontend pid %d sent no heartbeat for %.1f s (stopped, or its event loop is stuck): "
                          "killed, to be started again", proc.pid, now - max(started, heard or started))
                proc.kill()

    def kill_wedged(self, link: Link) -> None:
        """A frontend that stopped reading its link (its requests are aborted already) is killed, so the watch
        starts it again: alive, it would keep taking connections on the shared port and answering none."""
        for proc in self.procs:
            if link.pid and proc.pid == link.pid and proc.poll() is None:
                log.error("API frontend pid %d reads nothing of its link: killed, to be started again", proc.pid)
                proc.kill()

    async def _until_linked(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.servicer.links) < len(self.procs):
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"an API frontend (pid {dead[0].pid}) exited with {dead[0].returncode} before it "
                                   f"linked to the coordinator; its log is above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.servicer.links)} of {len(self.procs)} API frontends linked to the "
                                   f"coordinator within {START_TIMEOUT_S:g} s")
            await asyncio.sleep(POLL_S)

    async def _restart_exited(self) -> None:
        """A frontend that exits (it holds no request state: its requests were aborted with its link) is started
        again; one that keeps exiting soon after its start waits longer each time. One gone silent is killed first."""
        waits = [RESTART_BACKOFF_S[0]] * len(self.procs)
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            self.kill_silent(time.monotonic())
            for i, proc in enumerate(self.procs):
                if proc.poll() is None or self._stopping:
                    continue
                ran = time.monotonic() - self.started[i]
                waits[i] = RESTART_BACKOFF_S[0] if ran >= STEADY_S else min(waits[i] * 2, RESTART_BACKOFF_S[1])
                log.error("API frontend %d (pid %d) exited with %s after %.1f s; starting it again in %g s", i,
                          proc.pid, proc.returncode, ran, waits[i])
                await asyncio.sleep(waits[i])
                if not self._stopping:
                    self._spawn(i)

    async def cleanup(self) -> None:
        """Stop the frontends (each gives its streams the shutdown grace, then is killed), then the link."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        at_once = ""
        try:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.shutdown_grace + KILL_AFTER_GRACE_S
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:  # told to stop at once (a second Ctrl-C): killing them is what was asked
            at_once = AT_ONCE
            raise
        finally:
            await self.stop_now(at_once)

    async def stop_now(self, starting: str = "") -> None:
        """Kill what still runs (`starting` as for `close_now`), then stop the link: the end of `cleanup`, and the
        whole stop where the run is told to stop at once before `cleanup` began."""
        self.close_now(starting)
        for proc in self.procs:  # killed: gone at once; the link must not stop while their connections reset
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(KILL_WAIT_S)
        await self.server.stop(0)  # here, even when cancelled: not when grpc collects it after the loop closed

    def close_now(self, starting: str = "") -> None:
        """Kill what still runs and remove the link's directory; safe to call more than once, and when cancelled.
        `starting`: why a frontend still runs is no fault (logged so, not as an error)."""
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                if starting:
                    log.info("API frontend pid %d %s; killed", proc.pid, starting)
                else:
                    log.error("API frontend pid %d did not stop; killed", proc.pid)
                proc.kill()
                proc.wait()
        self.sock.close()
        shutil.rmtree(self.link_dir, ignore_errors=True)
