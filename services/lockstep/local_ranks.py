"""Rank processes on this machine: the command line that starts one, and stopping a set of them.

`lockstep serve` and `lockstep bench` start the same `lockstep rank` processes a pod runs, with the
same flags, so what they measure and serve is what a cluster runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from lockstep.local_group import free_port

EXIT_GROUP_BROKEN = 3  # a rank's exit code once its group broke (a peer died mid-collective): restarted
EXIT_UNSERVABLE = 4  # a rank's exit code for a checkpoint it cannot serve (its log says why): not restarted


def rank_command(rank: int, world_size: int, rendezvous: str, port: int, model: str | Path, page_size: int,
                 kv_pages: int, threads: int, prefix_caching: bool = True, dtype: str = "auto") -> list[str]:
    """`lockstep rank` for rank `rank` of a local group whose rank 0 keeps the store at `rendezvous`."""
    cmd = [sys.executable, "-m", "lockstep.cli", "rank", "--rank", str(rank), "--world-size", str(world_size),
           "--rendezvous", rendezvous, "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
           "--page-size", str(page_size), "--kv-pages", str(kv_pages), "--threads", str(threads), "--dtype", dtype]
    if not prefix_caching:
        cmd.append("--no-prefix-caching")
    return cmd


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running (and SIGCONT: a stopped one acts on its SIGTERM only once continued),
    then SIGKILL what has not exited after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class LocalRanks:
    """One local group's rank processes, supervised as the operator supervises pods: when one dies, the
    others are stopped and the whole group starts again with a fresh rendezvous (a torch.distributed
    group cannot take a new member), at the same ports, so the coordinator finds it where it was.

    `commands(rendezvous)` gives every rank's command line. A group that keeps dying before it ever
    became whole (`mark_whole`, called when the coordinator serves it) is crash-looping, and is given
    up after `max_quick_failures` such deaths in a row, with a growing pause between; a group that died
    after serving (a killed rank, a lost node) is always started again at once.
    """

    def __init__(self, commands: Callable[[str], list[list[str]]], env: Mapping[str, str],
                 max_quick_failures: int = 5, name: str = "g0", pause_s: float = 0.5) -> None:
        self.name = name
        self.commands = commands
        self.env = dict(env)
        self.max_quick_failures = max_quick_failures
        self.pause_s = pause_s
        self.procs: list[subprocess.Popen] = []
        self.whole = False
        self.restarts = 0

    def start(self) -> None:
        rendezvous = f"127.0.0.1:{free_port()}"
        env = {**self.env, "LOCKSTEP_PARENT_PID": str(os.getpid())}  # each rank stops once this process is gone
        self.procs = [subprocess.Popen(cmd, env=env, start_new_session=True) for cmd in self.commands(rendezvous)]
        self.whole = False

    def mark_whole(self) -> None:
        """The coordinator serves this group: a death from now on is not a crash loop."""
        self.whole = True

    async def supervise(self, progress: Callable[[str], None]) -> None:
        """Keep the group up; returns only when it cannot be kept up (it died too often, too soon), with
        its ranks stopped so that a given-up group holds no processes while the other groups serve."""
        quick = 0
        while True:
            rank, code = await self._first_exit()
            quick = 0 if self.whole else quick + 1
            if code == EXIT_UNSERVABLE:
                progress(f"{self.name}: rank {rank} cannot serve the checkpoint (its log above says why); giving up")
                await asyncio.to_thread(stop_processes, self.procs)
                return
            if quick >= self.max_quick_failures:
                progress(f"{self.name}: rank {rank} exited with code {code}; the group died {quick} times in a "
                         f"row before it could serve, giving up")
                await asyncio.to_thread(stop_processes, self.procs)
                return
            self.restarts += 1
            progress(f"{self.name}: rank {rank} exited with code {code}; restarting the group "
                     f"(restart {self.restarts})")
            await asyncio.to_thread(stop_processes, self.procs)
            await asyncio.sleep(min(30.0, self.pause_s * 2 ** quick) if quick else 0.0)
            self.start()

    async def _first_exit(self) -> tuple[int, int]:
        while True:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    return i, p.returncode
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        stop_processes(self.procs)


def stop_groups(groups: list[LocalRanks], grace_s: float = 10.0) -> None:
    """Every group's ranks at once, within one `grace_s`: one group after another, ranks that do not act on their
    SIGTERM held the stop for a grace per group."""
    stop_processes([p for g in groups for p in g.procs], grace_s)


async def supervise_all(groups: list[LocalRanks], progress: Callable[[str], None]) -> None:
    """Supervise every local group on its own; returns only when all of them gave up, because the
    coordinator routes around a down group and the others can go on serving."""
    await asyncio.gather(*(g.supervise(progress) for g in groups))
    progress(f"every group ({len(groups)}) gave up")
