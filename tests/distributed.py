"""Run test functions in N real processes joined by a gloo process group.

Starting processes and a torch.distributed group costs seconds, so a `ProcessGroup` is started once
(per test file, as a fixture) and then runs many functions: `group.run(fn, *args)` calls
`fn(comm, *args)` on every rank and returns the results in rank order. `fn` must be importable by
name (a module-level function) and its module must not import transformers at import time.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, rendezvous: str, inbox: mp.Queue, outbox: mp.Queue,
            env: dict[str, str] | None = None) -> None:
    import os

    import torch

    os.environ.update(env or {})
    torch.set_num_threads(1)
    from lockstep.parallel.comm import init_comm

    try:
        comm = init_comm(rank, world_size, rendezvous, torch.device("cpu"), timeout_s=120)
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))
        return
    outbox.put((rank, True, "ready"))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(comm, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    comm.close()


class ProcessGroup:
    """N spawned ranks that stay up and run one function at a time, all ranks together.

    `env` is set in each rank before it joins (say LOCKSTEP_COMM, to pick the collectives' transport).
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.broken = ""
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        rendezvous = f"127.0.0.1:{free_port()}"
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, rendezvous, self.inboxes[r], self.outbox, env),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._collect("start-up")

    def _collect(self, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        while len(results) + len(errors) < self.world_size:
            try:
                rank, ok, value = self.outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results))
                self._fail(f"{what}: ranks {missing} did not answer within {self.timeout_s:.0f} s")
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                if len(errors) == 1:
                    # The other ranks may be blocked in a collective the failed one never joined.
                    deadline = min(deadline, time.monotonic() + 10)
        if errors:
            self._fail(f"{what} failed\n" + "\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    def _fail(self, message: str) -> None:
        self.broken = message
        self.close()
        raise RuntimeError(message)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(comm, *args) on every rank; the results in rank order. A failure breaks the group."""
        if self.broken:
            raise RuntimeError(f"process group is broken by an earlier failure: {self.broken}")
        for inbox in self.inboxes:
            inbox.put((fn, args))
        return self._collect(getattr(fn, "__name__", "job"))

    def close(self) -> None:
        for inbox, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """One-shot: start a group, run fn(comm, *args) on every rank, stop the group."""
    group = ProcessGroup(world_size)
    try:
        return group.run(fn, *args)
    finally:
        group.close()
