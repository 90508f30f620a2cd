"""Rank processes on this machine: the command line that starts one, and stopping a set of them.

`lockstep serve` and `lockstep bench` start the same `lockstep rank` processes a pod runs, with the
same flags, so what they measure and serve is what a cluster runs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def rank_command(rank: int, world_size: int, rendezvous: str, port: int, model: str | Path, page_size: int,
                 kv_pages: int, threads: int, prefix_caching: bool = True) -> list[str]:
    """`lockstep rank` for rank `rank` of a local group whose rank 0 keeps the store at `rendezvous`."""
    cmd = [sys.executable, "-m", "lockstep.cli", "rank", "--rank", str(rank), "--world-size", str(world_size),
           "--rendezvous", rendezvous, "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
           "--page-size", str(page_size), "--kv-pages", str(kv_pages), "--threads", str(threads)]
    if not prefix_caching:
        cmd.append("--no-prefix-caching")
    return cmd


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, then SIGKILL what has not exited after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
