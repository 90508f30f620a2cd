"""Two coordinators on one group: the second waits, the first is never disturbed (found by a helper: they took
the ranks from each other ~470 times a second, and at TP 3 their interleaved plans made every rank exit).

Real rank services (`RankServer`, gRPC) around an engine that only counts steps; real `GroupRanks` links.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from lockstep.coordinator.group_ranks import GroupRanks
from lockstep.coordinator.metrics import Metrics
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep.rank.service import RankServer, RankServicer
from lockstep.steps import Plan, RankInfo, Report
from lockstep.stream_metadata import COORDINATOR_METADATA
from lockstep.wire import plan_to_proto, report_from_proto

WAIT_S = 10.0


class CountingEngine:
    def __init__(self, rank: int, world_size: int, page_size: int = 4) -> None:
        self.rank, self.world_size, self.page_size = rank, world_size, page_size
        self.executed: list[int] = []

    def info(self) -> RankInfo:
        return RankInfo(self.rank, self.world_size, "counting", self.page_size, (("full", 8),), 64, 101)

    def step(self, plan: Plan) -> Report:
        self.executed.append(plan.step)
        return Report(plan.step, self.rank)


@pytest.fixture
def ranks():
    engines = [CountingEngine(r, 2) for r in range(2)]
    servers = [RankServer(RankServicer(r, e), "127.0.0.1:0") for r, e in enumerate(engines)]
    for s in servers:
        s.start()
        s.set_serving(True)
    yield engines, [f"127.0.0.1:{s.port}" for s in servers]
    for s in servers:
        s.stop(grace=0.2)


class RawStream:
    """A Step stream opened by hand, as coordinator `name`: plans in through a queue, reports out."""

    def __init__(self, address: str, name: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.plans: queue.SimpleQueue = queue.SimpleQueue()
        self.call = rank_pb2_grpc.RankServiceStub(self.channel).Step(
            iter(self.plans.get, None), metadata=((COORDINATOR_METADATA, name),), timeout=3 * WAIT_S)

    def step(self, step: int) -> Report:
        self.plans.put(plan_to_proto(Plan(step=step)))
        return report_from_proto(next(self.call))

    def error(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            next(self.call)
        return err.value

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def test_a_rank_refuses_another_coordinator_while_the_first_streams(ranks) -> None:
    _, addresses = ranks
    a = RawStream(addresses[0], "coordinator-a")
    assert a.step(0).error == ""
    b = RawStream(addresses[0], "coordinator-b")
    err = b.error()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "driven by another coordinator (coordinator-a at" in err.details()
    assert a.step(1).error == ""  # the first is not disturbed
    a2 = RawStream(addresses[0], "coordinator-a")  # the same coordinator reconnecting takes over
    assert a2.step(2).error == ""
    assert a.error().code() == grpc.StatusCode.ABORTED
    a2.close()
    deadline = time.monotonic() + WAIT_S  # once its stream ended, another coordinator may take the rank
    while True:
        b = RawStream(addresses[0], "coordinator-b")
        try:
            assert b.step(3).error == ""
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline
            time.sleep(0.05)
    for s in (a, b):
        s.close()


def test_a_second_group_ranks_waits_and_the_first_keeps_stepping(ranks) -> None:
    engines, addresses = ranks

    async def run() -> None:
        first = GroupRanks("g0", addresses, Metrics(), 5.0, 10.0, coordinator_id="first")
        second = GroupRanks("g0", addresses, Metrics(), 5.0, 10.0, coordinator_id="second")
        reasons: list[str] = []
        try:
            infos = await first.connect(lambda why: None)
            step = infos[0].last_step + 1
            late = asyncio.ensure_future(second.connect(reasons.append))
            for k in range(step, step + 20):  # the second retries meanwhile, and never takes a rank
                first.send(Plan(step=k), set())
                reports = await asyncio.wait_for(first.gather(k), WAIT_S)
                assert [r.error for r in reports] == ["", ""]
                await asyncio.sleep(0.15)
            assert not late.done()
            assert any("driven by another coordinator (first at" in r for r in reasons), reasons
            await first.close()  # the first goes: the second takes the group over, at the step after the first's
            got = await asyncio.wait_for(late, WAIT_S)
            assert [i.last_step for i in got] == [step + 19] * 2
        finally:
            await first.close()
            await second.close()

    asyncio.run(run())
    assert all(e.executed == list(range(len(e.executed))) for e in engines)  # every step once, in order


def test_a_coordinator_that_cannot_serve_the_ranks_opens_no_stream(ranks) -> None:
    """A coordinator with another page size waits with its reason; the ranks' current stream stays current."""
    _, addresses = ranks
    a = RawStream(addresses[0], "serving")
    assert a.step(0).error == ""
    b = RawStream(addresses[1], "serving")
    assert b.step(0).error == ""

    async def run() -> list[str]:
        wrong = GroupRanks("g0", addresses, Metrics(), 5.0, 10.0, coordinator_id="serving")  # even the same id
        reasons: list[str] = []
        attempt = asyncio.ensure_future(wrong.connect(reasons.append, lambda infos: "page size 16, not 4"))
        await asyncio.sleep(2.5)
        assert not attempt.done()
        attempt.cancel()
        await wrong.close()
        return reasons

    assert asyncio.run(run()) == ["page size 16, not 4"]
    assert a.step(1).error == "" and b.step(1).error == ""  # not superseded
    a.close()
    b.close()




class SlowInfoEngine(CountingEngine):
    """Info takes a second while `slow` is set: two such calls hold a rank's two gRPC worker threads."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.slow = threading.Event()

    def info(self) -> RankInfo:
        if self.slow.is_set():
            time.sleep(1.0)
        return super().info()


def test_a_stream_cancelled_before_the_rank_took_it_does_not_hold_the_rank():
    """Found by a review: a coordinator that went away while its new stream waited for a worker thread left that
    stream current with nothing to end it, and every other coordinator was refused until the rank restarted."""
    engine = SlowInfoEngine()
    server = RankServer(RankServicer(0, engine), "127.0.0.1:0", max_workers=2)
    server.start()
    server.set_serving(True)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = rank_pb2_grpc.RankServiceStub(channel)
    try:
        engine.slow.set()
        busy = [stub.Info.future(pb.InfoRequest()) for _ in range(2)]
        time.sleep(0.1)
        gone = stub.Step(iter(()), metadata=((COORDINATOR_METADATA, "gone"),))
        time.sleep(0.1)
        gone.cancel()
        for f in busy:
            f.result()
        engine.slow.clear()
        deadline = time.monotonic() + WAIT_S
        while True:
            b = RawStream(f"127.0.0.1:{server.port}", "next")
            try:
                assert b.step(0).error == ""
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
                assert time.monotonic() < deadline, exc.details()
                b.close()
                time.sleep(0.2)
        b.close()
    finally:
        channel.close()
        server.stop(grace=0.2)


def test_a_coordinator_that_cannot_serve_never_holds_ranks_it_caught_up(ranks) -> None:
    """Found by a review: ranks left one step apart by a dead coordinator were caught up (streams opened) by one
    that cannot serve them, which then waited holding them: the coordinator that can was refused."""
    _, addresses = ranks
    old = [RawStream(a, "old") for a in addresses]
    for k in range(6):
        old[0].step(k)
    for k in range(5):
        old[1].step(k)  # the old coordinator died between its writes of plan 5
    for s in old:
        s.close()

    async def run() -> list[RankInfo]:
        wrong = GroupRanks("g0", addresses, Metrics(), 5.0, 10.0, coordinator_id="wrong")
        right = GroupRanks("g0", addresses, Metrics(), 5.0, 10.0, coordinator_id="right")
        waiting = asyncio.ensure_future(wrong.connect(lambda why: None, lambda infos: "page size 16, not 4"))
        try:
            await asyncio.sleep(2.5)
            return await asyncio.wait_for(right.connect(lambda why: None), WAIT_S)
        finally:
            waiting.cancel()
            await wrong.close()
            await right.close()

    assert [i.last_step for i in asyncio.run(run())] == [5, 5]  # rank 1 abstained from step 5 (caught up)


def test_why_a_group_waits_names_every_rank_and_what_grpc_said():
    """Found by a helper: a rank still loading, a TLS handshake refused and a dead process all read "does not answer
    (UNAVAILABLE)", and only the first such rank was named."""
    loading = RankServer(RankServicer(0, None), "127.0.0.1:0")  # no engine yet: it answers UNAVAILABLE, loading
    loading.start()
    dead = RankServer(RankServicer(1, CountingEngine(1, 2)), "127.0.0.1:0")
    dead.start()
    dead_port = dead.port
    dead.stop(grace=0)

    async def run() -> str:
        ranks = GroupRanks("g0", [f"127.0.0.1:{loading.port}", f"127.0.0.1:{dead_port}"], Metrics(), 5.0, 10.0)
        try:
            return (await ranks._infos())[1]
        finally:
            await ranks.close()

    try:
        why = asyncio.run(run())
    finally:
        loading.stop(grace=0.2)
    assert "rank 0 at" in why and "rank 0 is still loading its engine" in why
    assert "rank 1 at" in why and "UNAVAILABLE" in why


FROZEN_CLIENT = """
import sys, threading
import grpc
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep.steps import Plan
from lockstep.stream_metadata import COORDINATOR_METADATA
from lockstep.wire import plan_to_proto

done = threading.Event()

def plans():
    yield plan_to_proto(Plan(step=0))
    done.wait()

channel = grpc.insecure_channel(sys.argv[1])
call = rank_pb2_grpc.RankServiceStub(channel).Step(plans(), metadata=((COORDINATOR_METADATA, "frozen"),))
next(call)
print("stepped", flush=True)
done.wait()
"""


def test_a_coordinator_that_answers_nothing_any_more_is_dropped_after_the_keepalive(monkeypatch) -> None:
    """A coordinator frozen (SIGSTOP, its node gone silent, a partition: no FIN, no RST) answers no keepalive
    ping, so the rank ends its stream and a new coordinator takes the rank after about two KEEPALIVE_MS. With
    only grpc's keepalive_timeout_ms set, its ping timeout (60 s by default) bounded it: the new coordinator was
    refused for a minute."""
    import os
    import signal
    import subprocess
    import sys

    from lockstep.rank import service

    monkeypatch.setattr(service, "KEEPALIVE_MS", 1000)
    server = RankServer(RankServicer(0, CountingEngine(0, 1)), "127.0.0.1:0")
    server.start()
    server.set_serving(True)
    address = f"127.0.0.1:{server.port}"
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_CLIENT, address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stepped"
        time.sleep(3.0)  # an idle group: three keepalive intervals with no plan, pings go on without data
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while True:
            new = RawStream(address, "new")
            try:
                assert new.step(1).error == ""
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
                assert time.monotonic() - t0 < 15, "the frozen coordinator still holds the rank"
                time.sleep(0.2)
            finally:
                new.close()
        assert time.monotonic() - t0 < 6
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        server.stop(grace=0.2)
