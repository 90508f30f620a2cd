"""`--api-workers N`: the HTTP API in N frontend processes (remote.py) instead of the coordinator's own loop.

At large batch the coordinator's time per streamed token (detokenizing, stop strings, the SSE chunk's JSON,
the socket write: 35-46 us, 9-12 ms per step at batch 256, scripts/bench_stream_frontend.py) is three times
its scheduling. vLLM splits the same way (`--api-server-count`): N processes share the HTTP port
(SO_REUSEPORT) and each gets one message per step from the coordinator. The coordinator then serves only
gRPC itself; /health, /metrics and /admin are answered by the frontends from the coordinator's own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.frontend_link import start_link
from lockstep.coordinator.service import Coordinator

log = logging.getLogger("lockstep.api_workers")
RESTART_BACKOFF_S = 1.0  # a frontend that exits is started again after this long (it holds no request state)
POLL_S = 0.5


class ApiWorkers:
    """The frontend processes and the link they hold; `cleanup` stops both, as an HTTP runner's would."""

    def __init__(self, config: CoordinatorConfig, model_dir: Path, link_dir: str, server: grpc.aio.Server) -> None:
        self.config, self.model_dir, self.link_dir, self.server = config, model_dir, link_dir, server
        self.address = f"unix:{link_dir}/link.sock"
        self.procs: list[subprocess.Popen] = []
        self._stopping = False
        self._watch: asyncio.Task | None = None

    @classmethod
    async def start(cls, coordinator: Coordinator, config: CoordinatorConfig, model_dir: Path) -> ApiWorkers:
        link_dir = tempfile.mkdtemp(prefix="lockstep-link-")  # 0700: only this user reaches the link
        server, _ = await start_link(coordinator, f"unix:{link_dir}/link.sock")
        workers = cls(config, model_dir, link_dir, server)
        workers.procs = [workers._spawn() for _ in range(config.api_workers)]
        workers._watch = asyncio.ensure_future(workers._restart_exited())
        return workers

    def _spawn(self) -> subprocess.Popen:
        c = self.config
        env = dict(os.environ, LOCKSTEP_API_KEY=",".join(c.api_keys))  # by environment, never on a command line
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep.coordinator.remote", "--link", self.address, "--model",
             str(self.model_dir), "--host", c.host, "--port", str(c.http_port), "--shutdown-grace",
             str(c.shutdown_grace)], env=env)

    async def _restart_exited(self) -> None:
        while not self._stopping:
            await asyncio.sleep(POLL_S)
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and not self._stopping:
                    log.error("API frontend %d (pid %d) exited with %s; starting it again in %g s", i, proc.pid,
                              proc.returncode, RESTART_BACKOFF_S)
                    await asyncio.sleep(RESTART_BACKOFF_S)
                    if not self._stopping:
                        self.procs[i] = self._spawn()

    async def cleanup(self) -> None:
        """Stop the frontends (each gives its streams the shutdown grace), then the link."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + self.config.shutdown_grace + 10.0
        while any(p.poll() is None for p in self.procs) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                log.error("API frontend pid %d did not stop; killed", proc.pid)
                proc.kill()
                proc.wait()
        await self.server.stop(0)
        shutil.rmtree(self.link_dir, ignore_errors=True)
