"""The rank service over real gRPC: order, one execution per plan, errors as reports, health, reconnect.

The engine here is the real page bookkeeping (`RankCache`) with a fake forward (no model), so every report
carries real page accounting across the wire and a plan executed twice or out of order shows up in the counts.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lockstep.kv.allocator import PagePool
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.kv.rank_cache import RankCache, StepRefused
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep.rank.main import default_rank, parse_args
from lockstep.rank.service import SERVICE_NAME, RankServer, RankServicer
from lockstep.steps import Admit, Chunk, Plan, PoolState, Probe, ProbeAnswer, RankInfo, Report, Sampled, Timings
from lockstep.wire import info_from_proto, plan_to_proto, report_from_proto

PAGE = 4
PAGES = 16
VOCAB = 101
SALT = key_salt("pool-engine", PAGE)


class PoolEngine:
    """The engine's own page bookkeeping (`RankCache` over one pool) around a fake forward that samples
    (sum of the chunk's tokens + sample index) mod VOCAB. Unlike the engine, it raises what refuses a step,
    so the servicer's path for an engine exception is exercised too."""

    def __init__(self, rank: int = 0, pages: int = PAGES) -> None:
        self.rank = rank
        self.cache = RankCache(PagePool("full", pages), PAGE, SALT, max_model_len=64, rank=rank)
        self.executed: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self._busy = threading.Lock()

    @property
    def pool(self) -> PagePool:
        return self.cache.pool

    def info(self) -> RankInfo:
        return RankInfo(self.rank, 1, "pool-engine", PAGE, self.cache.totals(), 64, VOCAB)

    def step(self, plan: Plan) -> Report:
        if not self._busy.acquire(blocking=False):
            raise AssertionError("two steps ran at once")
        try:
            self.entered.set()
            self.gate.wait()
            self.executed.append(plan.step)
            return self._step(plan)
        finally:
            self._busy.release()

    def _step(self, plan: Plan) -> Report:
        t0 = time.perf_counter()
        try:
            self.cache.prepare(plan)
        except StepRefused as exc:
            self.cache.undo_admits()
            raise exc.__cause__ from None
        sampled = tuple(
            Sampled(c.request_id, (sum(c.token_ids) + c.sample_index) % VOCAB) for c in plan.batch if c.sample
        )
        for chunk in plan.batch:
            self.cache.advance(chunk)
        probes, pools = self.cache.finish(plan)
        self.cache.check()
        return Report(plan.step, self.rank, sampled, probes, pools, timings=Timings(step_s=time.perf_counter() - t0))


def slow_pool_engine(cfg) -> PoolEngine:
    """`lockstep rank`'s engine factory in the subprocess tests: loads for a moment, like a real one."""
    time.sleep(float(os.environ.get("TEST_ENGINE_LOAD_SECONDS", "1.0")))
    return PoolEngine(rank=cfg.rank, pages=cfg.kv_pages or PAGES)


class ThreadNamingEngine(PoolEngine):
    """A PoolEngine whose Info names the threads that built it and ran its steps (`lockstep rank` runs both on
    one engine thread: two OpenMP teams made a decode step 1.9x as slow)."""

    def __init__(self, rank: int, pages: int) -> None:
        super().__init__(rank=rank, pages=pages)
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self, plan: Plan) -> Report:
        self.stepped_on.add(threading.get_ident())
        return super().step(plan)

    def info(self) -> RankInfo:
        main = threading.main_thread().ident
        return replace(super().info(), model_id=f"built-on-main={self.built_on == main} "
                                                f"steps-on-builder={self.stepped_on == {self.built_on}}")


def thread_naming_engine(cfg) -> ThreadNamingEngine:
    return ThreadNamingEngine(cfg.rank, cfg.kv_pages or PAGES)


class StepStream:
    """The coordinator's side of one Step stream: send a plan, read its report."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reports = rank_pb2_grpc.RankServiceStub(channel).Step(iter(self._outbox.get, None), timeout=20)

    def send(self, plan: Plan | pb.PlanMsg) -> None:
        self._outbox.put(plan if isinstance(plan, pb.PlanMsg) else plan_to_proto(plan))

    def recv(self) -> Report:
        return report_from_proto(next(self._reports))

    def step(self, plan: Plan | pb.PlanMsg) -> Report:
        self.send(plan)
        return self.recv()

    def close(self) -> None:
        self._outbox.put(None)


def pool(report: Report) -> PoolState:
    assert not report.error, report.error
    (state,) = report.pools
    return state


@pytest.fixture
def rank():
    """A served rank: (engine, servicer, channel, address)."""
    engine = PoolEngine()
    servicer = RankServicer(0, engine)
    server = RankServer(servicer, "127.0.0.1:0")
    server.start()
    server.set_serving(True)
    address = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(address)
    yield engine, servicer, channel, address
    channel.close()
    server.stop(grace=0.2)


PROMPT = list(range(1, 11))  # 10 tokens: 2 full pages and a partial one
KEYS = page_keys(PROMPT, PAGE, SALT)


def test_plans_run_in_order_with_real_page_accounting(rank):
    engine, servicer, channel, _ = rank
    s = StepStream(channel)
    r0 = s.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", tuple(PROMPT), 0, sample=True),)))
    assert r0.step == 0 and r0.rank == 0
    assert r0.sampled == (Sampled("a", sum(PROMPT) % VOCAB),)
    assert pool(r0) == PoolState("full", PAGES, PAGES - 3, 0, 3, pinned=2)
    assert 0 < r0.timings.step_s <= r0.timings.rank_step_s  # the engine's timings, and the service's own
    r1 = s.step(Plan(step=1, batch=(Chunk("a", (11, 12), 10, sample=True, sample_index=1),)))
    assert pool(r1) == PoolState("full", PAGES, PAGES - 3, 0, 3, pinned=3)
    r2 = s.step(Plan(step=2, releases=("a",), probes=(Probe("b", tuple(KEYS) + (b"unknown",)),)))
    assert pool(r2) == PoolState("full", PAGES, PAGES - 3, 3, 0)
    assert r2.probes == (ProbeAnswer("b", 2, 0),)
    r3 = s.step(Plan(step=3, admits=(Admit("b", tuple(KEYS)),), batch=(Chunk("b", (9, 10), 8),)))
    assert pool(r3) == PoolState("full", PAGES, PAGES - 4, 1, 3, pinned=2)
    assert engine.executed == [0, 1, 2, 3]
    assert servicer.last_step == 3
    info = info_from_proto(rank_pb2_grpc.RankServiceStub(channel).Info(pb.InfoRequest()))
    assert info.last_step == 3 and info.pool_totals == {"full": PAGES} and info.page_size == PAGE
    s.close()


def test_duplicate_plan_is_answered_again_and_executed_once(rank):
    engine, servicer, channel, _ = rank
    s = StepStream(channel)
    s.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", tuple(PROMPT[:8]), 0),)))
    s.step(Plan(step=1, releases=("a",)))
    admit = Plan(step=2, admits=(Admit("b", tuple(KEYS)),), batch=(Chunk("b", (9,), 8),))
    first = s.step(admit)
    again = s.step(admit)
    assert again == first
    assert engine.executed == [0, 1, 2]
    # Pinned once: releasing b leaves nothing referenced. A second pin would have left a reference.
    assert pool(first) == PoolState("full", PAGES, PAGES - 3, 0, 3, pinned=2)
    done = s.step(Plan(step=3, releases=("b",)))
    assert pool(done) == PoolState("full", PAGES, PAGES - 2, 2, 0)
    engine.cache.check()


def test_out_of_order_and_conflicting_plans_are_refused_not_run(rank):
    engine, servicer, channel, _ = rank
    s = StepStream(channel)
    s.step(Plan(step=5, admits=(Admit("a"),), batch=(Chunk("a", (1, 2), 0),)))
    skipped = s.step(Plan(step=7, releases=("a",)))
    assert skipped.step == 7 and "expected step 6 (or 5 again), got 7" in skipped.error
    older = s.step(Plan(step=4))
    assert "expected step 6" in older.error
    conflicting = s.step(Plan(step=5, releases=("a",)))
    assert "step 5 was already carried out with a different plan" in conflicting.error
    assert engine.executed == [5]
    r6 = s.step(Plan(step=6, batch=(Chunk("a", (3,), 2),)))
    assert pool(r6).used == 1 and engine.executed == [5, 6]


def test_engine_exception_becomes_report_error_and_the_stream_goes_on(rank):
    engine, servicer, channel, _ = rank
    s = StepStream(channel)
    before = pool(s.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", tuple(PROMPT[:4]), 0),))))
    refused = s.step(Plan(step=1, admits=(Admit("b", (KEYS[0], KEYS[1])),)))
    assert refused.step == 1 and refused.rank == 0 and refused.pools == ()
    assert refused.error.startswith("PrefixNotHeld:")
    assert "asked to pin 2 prefix pages but the index holds only the first 1" in refused.error
    bug = s.step(Plan(step=2, batch=(Chunk("ghost", (1,), 0),)))
    assert "StepRefused" in bug.error and "request ghost is not admitted" in bug.error
    after = s.step(Plan(step=3, probes=(Probe("b", tuple(KEYS)),)))
    assert pool(after) == before
    assert after.probes == (ProbeAnswer("b", 1, 1),)
    assert servicer.last_step == 3


def test_bad_plan_on_the_wire_is_answered_and_not_run(rank):
    engine, servicer, channel, _ = rank
    s = StepStream(channel)
    bad = s.step(pb.PlanMsg(step=0, batch=pb.BatchMsg(request_ids=["a"], token_counts=[0], starts=[0], sample=[False],
                                                      sample_index=[0], sampling=[0])))
    assert bad.step == 0 and "bad plan" in bad.error and "at least one token" in bad.error
    assert engine.executed == [] and servicer.last_step == -1
    ok = s.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", (1,), 0),)))
    assert pool(ok).used == 1 and engine.executed == [0]


def test_reconnect_supersedes_the_old_stream_and_resend_is_not_rerun(rank):
    engine, servicer, channel, address = rank
    old = StepStream(channel)
    old.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", tuple(PROMPT[:8]), 0),)))
    slow = Plan(step=1, admits=(Admit("b", tuple(KEYS)),), batch=(Chunk("b", (9,), 8),))
    engine.gate.clear()
    engine.entered.clear()
    old.send(slow)
    assert engine.entered.wait(10)
    reconnected = grpc.insecure_channel(address)
    new = StepStream(reconnected)
    new.send(slow)  # the reconnecting coordinator resends the plan it has no report for
    time.sleep(0.3)
    assert engine.executed == [0]
    engine.gate.set()
    answered = old.recv()
    resent = new.recv()
    assert resent == answered and engine.executed == [0, 1]
    assert pool(resent).pinned == 2
    with pytest.raises(grpc.RpcError) as e:
        old.recv()
    assert e.value.code() == grpc.StatusCode.ABORTED and "superseded" in e.value.details()
    r2 = new.step(Plan(step=2, releases=("a", "b")))
    assert pool(r2) == PoolState("full", PAGES, PAGES - 2, 2, 0) and engine.executed == [0, 1, 2]
    reconnected.close()


def _health(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_and_step_while_the_engine_loads():
    servicer = RankServicer(2)
    server = RankServer(servicer, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        for name in ("", SERVICE_NAME):
            assert _health(channel, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            StepStream(channel).step(Plan(step=0))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            rank_pb2_grpc.RankServiceStub(channel).Info(pb.InfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        servicer.attach(PoolEngine(rank=2))
        server.set_serving(True)
        for name in ("", SERVICE_NAME):
            assert _health(channel, name) == health_pb2.HealthCheckResponse.SERVING
        s = StepStream(channel)
        assert s.step(Plan(step=0)).rank == 2
        server.stop(grace=0.2)
        with pytest.raises(grpc.RpcError) as e:
            s.step(Plan(step=1))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        server.stop(grace=0)


def test_parse_args_flags_env_and_pod_index():
    env = {"LOCKSTEP_WORLD_SIZE": "3", "LOCKSTEP_GRPC_PORT": "6000", "LOCKSTEP_PREFIX_CACHING": "0"}
    cfg = parse_args([], env=env, hostname="demo-g0-2")
    assert (cfg.rank, cfg.world_size, cfg.port, cfg.prefix_caching) == (2, 3, 6000, False)
    assert (cfg.rendezvous, cfg.host, cfg.model, cfg.page_size, cfg.kv_pages) == (
        "127.0.0.1:29500", "0.0.0.0", "builtin", 16, 0,
    )  # fmt: skip
    cfg = parse_args(["--rank", "0", "--port", "7000", "--threads", "1"], env={**env, "LOCKSTEP_POD_INDEX": "1"})
    assert (cfg.rank, cfg.port, cfg.threads) == (0, 7000, 1)
    assert parse_args([], env={**env, "LOCKSTEP_POD_INDEX": "1"}, hostname="x-2").rank == 1
    assert parse_args(["--no-prefix-caching"], env={}, hostname="laptop").prefix_caching is False
    assert parse_args([], env={}, hostname="laptop").rank == 0
    assert default_rank({}, "lockstep-g1-10") == 10 and default_rank({}, "laptop") is None


@pytest.mark.parametrize(
    "argv, env, words",
    [
        ([], {"LOCKSTEP_WORLD_SIZE": "2"}, "cannot tell this rank"),
        (["--rank", "3", "--world-size", "3"], {}, "rank 3 is outside a group of 3 ranks"),
        ([], {"LOCKSTEP_GRPC_PORT": "http"}, "LOCKSTEP_GRPC_PORT must be an integer, got 'http'"),
        (["--rendezvous", "nohost"], {}, "--rendezvous must be host:port"),
        (["--kv-memory-fraction", "1.5"], {}, "--kv-memory-fraction must be in (0, 1]"),
        ([], {"LOCKSTEP_PREFIX_CACHING": "maybe"}, "LOCKSTEP_PREFIX_CACHING must be 0 or 1"),
    ],
)
def test_parse_args_refuses_bad_input_by_name(argv, env, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, env=env, hostname="laptop")
    assert words in f"{e.value.code}{capsys.readouterr().err}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_rank(port: int, load_seconds: float, extra_env: dict[str, str] | None = None,
                factory: str = "slow_pool_engine", threads: int = 1) -> subprocess.Popen:
    tests = Path(__file__).parent
    code = (
        f"import logging, sys; sys.path.insert(0, {str(tests)!r}); logging.basicConfig(level=logging.INFO);"
        f"from test_rank_service import {factory};"
        "from lockstep.rank.main import parse_args, run;"
        f"sys.exit(run(parse_args(sys.argv[1:]), {factory}))"
    )
    env = {
        **os.environ,
        "LOCKSTEP_POD_INDEX": "1",
        "LOCKSTEP_WORLD_SIZE": "2",
        "LOCKSTEP_GRPC_PORT": str(port),
        "TEST_ENGINE_LOAD_SECONDS": str(load_seconds),
        **(extra_env or {}),
    }
    argv = ["--host", "127.0.0.1", "--threads", str(threads), "--kv-pages", "8"]
    return subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stderr=subprocess.PIPE, text=True)


def _wait_for_health(channel: grpc.Channel, want: int, deadline: float) -> list[int]:
    seen = []
    while time.monotonic() < deadline:
        try:
            status = _health(channel)
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == want:
                return seen
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"health never reached {want}; saw {seen}")


def test_rank_process_health_then_sigterm_exits_cleanly():
    port = _free_port()
    proc = _start_rank(port, load_seconds=5.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        seen = _wait_for_health(channel, health_pb2.HealthCheckResponse.SERVING, time.monotonic() + 60)
        assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
        info = info_from_proto(rank_pb2_grpc.RankServiceStub(channel).Info(pb.InfoRequest(), timeout=5))
        assert info.rank == 1 and info.pool_totals == {"full": 8}
        s = StepStream(channel)
        r = s.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", (1, 2, 3, 4, 5), 0),)))
        assert r.rank == 1 and pool(r) == PoolState("full", 8, 6, 0, 2, pinned=1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(grpc.RpcError) as e:
            s.step(Plan(step=1))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopped after step 0" in proc.stderr.read()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("threads, named", [(2, "built-on-main=False steps-on-builder=True"),
                                             (1, "built-on-main=False steps-on-builder=False")])
def test_rank_process_builds_its_engine_and_runs_every_step_on_one_thread_not_the_main_one(threads, named):
    """With torch threads, one engine thread does it all; with one (no OpenMP team) the steps stay on
    each Step stream's step thread, where they cost no hop."""
    port = _free_port()
    proc = _start_rank(port, load_seconds=0, factory="thread_naming_engine", threads=threads)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_for_health(channel, health_pb2.HealthCheckResponse.SERVING, time.monotonic() + 60)
        for step in range(4):  # a new stream each time: another step thread
            StepStream(channel).step(Plan(step=step))
        info = info_from_proto(rank_pb2_grpc.RankServiceStub(channel).Info(pb.InfoRequest(), timeout=5))
        assert info.model_id == named
    finally:
        channel.close()
        proc.kill()
        proc.wait()


def test_rank_process_sigterm_while_loading_exits_cleanly():
    port = _free_port()
    proc = _start_rank(port, load_seconds=30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_for_health(channel, health_pb2.HealthCheckResponse.NOT_SERVING, time.monotonic() + 60)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_while_waiting_for_the_peers_exits_cleanly(tiny_llama, tmp_path, rank):
    """Found by a helper: a rank of one torch thread built its engine on the main thread, so while the group's
    rendezvous waited for a peer (torch's C++ TCP store: rank 0 serving it, rank 1 retrying to reach it) Python never
    ran its SIGTERM handler, and the rank kept waiting for up to the store's 10-minute timeout: in a rolling restart
    the kubelet had to SIGKILL it after the grace period."""
    from lockstep.local_ranks import rank_command

    port = _free_port()
    cmd = rank_command(rank, 2, f"127.0.0.1:{_free_port()}", port, tiny_llama, 16, 8, threads=1)
    log = tmp_path / "rank.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_for_health(channel, health_pb2.HealthCheckResponse.NOT_SERVING, time.monotonic() + 60)
        time.sleep(4.0)  # the tiny checkpoint is read: the rank waits in the rendezvous for its peer, who never comes
        assert proc.poll() is None, log.read_text()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=20) == 0, log.read_text()[-3000:]
        except subprocess.TimeoutExpired:
            tail = log.read_text()[-3000:]
            raise AssertionError(f"SIGTERM did not stop a rank waiting for its peers:\n{tail}") from None
        assert time.monotonic() - started < 10
        assert "SIGTERM received" in log.read_text()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_refused_plan_breaks_a_group_of_several_ranks():
    """Under TP the peers may be running the plan this rank cannot: the rank must go (and be recreated)
    rather than serve on while they wait for it in a collective."""
    from lockstep.rank.service import RankServicer

    class TwoRankEngine(PoolEngine):
        def info(self) -> RankInfo:
            return replace(super().info(), world_size=2)

    fatal: list[str] = []
    servicer = RankServicer(0, TwoRankEngine(), on_fatal=fatal.append)
    servicer.execute(Plan(step=0))
    assert not fatal
    report = servicer.execute(Plan(step=2))
    assert "expected step 1" in report.error
    assert fatal and "plan 2 cannot be carried out here" in fatal[0]
