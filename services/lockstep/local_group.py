"""A group of N engine ranks in N local processes, driven plan by plan without any server.

This is how tests and the in-process benchmark run the engine at TP > 1: the same Engine.step that
the rank service wraps, behind the same delivery rules (`StepGate`: in order, each plan once), with
real torch.distributed collectives (gloo on CPU) between processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from collections.abc import Sequence
from multiprocessing.connection import Connection

from lockstep.engine_config import EngineConfig
from lockstep.steps import Plan, RankInfo, Report, StepGate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(conn: Connection, cfg: EngineConfig, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from lockstep.engine import Engine

    rank = cfg.rank
    try:
        engine = Engine.create(cfg)
    except Exception as exc:  # the parent reports the failure; the child must not hang silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.info()))
    gate = StepGate(rank)

    def refuse(plan: Plan, why: str) -> Report:
        return Report(step=plan.step, rank=rank, error=why)

    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(gate.deliver(msg, engine.step, refuse))


class LocalGroup:
    """Start `world_size` ranks; `step(plan)` sends the plan to all and returns every report in rank order."""

    def __init__(
        self,
        model_dir: str,
        world_size: int,
        page_size: int = 16,
        kv_pages: int | Sequence[int] = 256,
        prefix_caching: bool = True,
        timeout_s: float = 300.0,
        dtype: str = "auto",
    ) -> None:
        pages = [kv_pages] * world_size if isinstance(kv_pages, int) else list(kv_pages)
        if len(pages) != world_size:
            raise ValueError(f"kv_pages names {len(pages)} ranks for a group of {world_size}")
        ctx = mp.get_context("spawn")
        rendezvous = f"127.0.0.1:{free_port()}"
        threads = max(1, (os.cpu_count() or 1) // world_size)
        self.timeout_s = timeout_s
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            cfg = EngineConfig(model=str(model_dir), rank=rank, world_size=world_size, rendezvous=rendezvous,
                               page_size=page_size, kv_pages=pages[rank], prefix_caching=prefix_caching,
                               dtype=dtype)
            proc = ctx.Process(target=_rank_main, args=(child, cfg, threads), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.infos: list[RankInfo] = [self._recv(rank, "ready") for rank in range(world_size)]

    def _recv(self, rank: int, expect: str | None = None):
        conn = self.conns[rank]
        if not conn.poll(self.timeout_s):
            self.close()
            raise TimeoutError(f"rank {rank} did not answer within {self.timeout_s} s")
        msg = conn.recv()
        if expect is not None:
            kind, body = msg
            if kind != expect:
                self.close()
                raise RuntimeError(f"rank {rank} failed to start: {body}")
            return body
        return msg

    def step(self, plan: Plan | Sequence[Plan]) -> list[Report]:
        """One plan for all ranks, or one plan per rank (only an operator's flush may differ per rank)."""
        plans = [plan] * len(self.conns) if isinstance(plan, Plan) else list(plan)
        for conn, rank_plan in zip(self.conns, plans, strict=True):
            conn.send(rank_plan)
        return [self._recv(rank) for rank in range(len(self.conns))]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs = []
        self.conns = []

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
