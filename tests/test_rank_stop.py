"""How `lockstep rank` exits when its group goes away under it: told to stop (0) or left behind (3)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from lockstep.local_ranks import EXIT_GROUP_BROKEN
from lockstep.steps import GroupBroken, Plan
from test_rank_service import PoolEngine, StepStream


class PeersStopEngine(PoolEngine):
    """Step 1 fails as a step does whose peers were told to stop before they ran it."""

    def step(self, plan: Plan):
        if plan.step == 1:
            print("step 1 runs", file=sys.stderr, flush=True)
            time.sleep(3.0)  # the test's SIGTERM lands meanwhile
            raise GroupBroken(f"rank {self.rank}: the agreement collective of step 1 failed: rank(s) [0] exited")
        return super().step(plan)


def peers_stop_engine(cfg) -> PoolEngine:
    return PeersStopEngine(rank=cfg.rank, pages=8)


def store_gone_engine(cfg) -> PoolEngine:
    import torch.distributed as dist

    time.sleep(0.5)
    raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")


def broken_while_loading_engine(cfg) -> PoolEngine:
    from lockstep.parallel import group_watch

    time.sleep(0.3)  # the group formed, its watch runs, the model loads
    group_watch._on_broken[0]("a rank of this group started again on its own and reached its store")
    time.sleep(60)  # a large model's load goes on
    return PoolEngine(rank=cfg.rank, pages=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, factory: str) -> subprocess.Popen:
    code = (f"import logging, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"logging.basicConfig(level=logging.INFO); from test_rank_stop import {factory};"
            f"from lockstep.rank.main import parse_args, run; sys.exit(run(parse_args(sys.argv[1:]), {factory}))")
    env = {**os.environ, "LOCKSTEP_POD_INDEX": "1", "LOCKSTEP_WORLD_SIZE": "2", "LOCKSTEP_GRPC_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-c", code, "--host", "127.0.0.1", "--threads", "1", "--kv-pages", "8"],
                            env=env, stderr=subprocess.PIPE, text=True)


def test_a_step_that_fails_because_the_peers_were_told_to_stop_too_leaves_the_exit_0():
    """Found by a helper: `lockstep serve`'s Ctrl-C under load at TP 3 (about one time in three) made a rank that
    had started a step its peers, stopping, never ran exit 3, "exiting so that the group is recreated"."""
    port = _free_port()
    proc = _start(port, "peers_stop_engine")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                StepStream(channel).step(Plan(step=0))
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the rank never served"
                time.sleep(0.1)
        stream = StepStream(channel)
        threading.Thread(target=lambda: _quietly(stream.step, Plan(step=1)), daemon=True).start()
        said = []
        for line in proc.stderr:  # until step 1 runs
            said.append(line)
            if line.strip() == "step 1 runs":
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "while stopping as told" in "".join(said) + proc.stderr.read()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("engine, timeout, said", [
    # rank 0's store went while the group formed: a broken group (3), not an engine that failed to start (1)
    ("store_gone_engine", 60, "the group's rendezvous failed"),
    # the watch starts as the group forms, before the model loads: a broken group's ranks kept loading for the
    # load's whole length, then exited 0, while the rank that started again waited for their store to go
    ("broken_while_loading_engine", 20, "exiting so that the group is recreated"),
])
def test_a_rank_whose_group_broke_before_it_served_exits_3(engine, timeout, said):
    proc = _start(_free_port(), engine)
    try:
        assert proc.wait(timeout=timeout) == EXIT_GROUP_BROKEN
        assert said in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except grpc.RpcError:
        pass


def test_a_rank_leaving_by_os_exit_still_writes_what_c_code_buffered():
    """NCCL_DEBUG's lines go to C's stdout, block-buffered in a pipe (a pod's log) unless PYTHONUNBUFFERED is set:
    exit() flushes it, os._exit does not."""
    code = ("import ctypes; from lockstep.rank.main import _exit_now; "
            "ctypes.CDLL(None).printf(b'NCCL WARN from C\\n'); _exit_now(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "NCCL WARN from C" in out.stdout
