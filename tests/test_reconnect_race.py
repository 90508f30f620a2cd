"""The reconnect race, made to happen on purpose: old plans against the coordinator's read of `last_step`.

A coordinator that (re)connects to a group reads each rank's `last_step` and plans the step after it. Plans
still queued on an older Step stream (this coordinator's before a reconnect; another's live stream makes the
ranks refuse this one's, `test_second_coordinator.py`) must
not run after that read, or some ranks move past the step the coordinator believes they are at; the next
plan then collides with the old one on those ranks only, and the group splits. `GroupRanks.connect`
prevents it by having every rank take over a new stream (which ends the old ones) before the Info read
that decides the step.

Two real ranks (`RankServicer` over gRPC) run a fake engine held inside step 5, with step 6 queued behind
it on the old stream. Hooks in the servicer let the old plans go at a chosen point of `connect`, and wait
until they have either run or been refused, so the interleaving is the same on every run:

- let go right after the first Info read: step 6 runs on the old streams, and `connect` must see it;
  with the reads and the takeover in the other order (read, then take over), it does not;
- let go right after the first Info read once the coordinator has opened its new streams, with the ranks
  slow to take them over: step 6 must never run; without the wait for the ranks' takeover it does;
- the same, with step 5 done and step 6 held just before it starts (past the old stream's own check that it
  is still current): step 6 must never run; unless the rank's check and the step's start are one atomic
  move against the newer stream's takeover, it does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from lockstep.coordinator.group_ranks import GroupRanks
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.rank_link import COORDINATOR_ID
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep.rank.service import RankServer, RankServicer
from lockstep.steps import Plan, RankInfo, Report, StepGate
from lockstep.stream_metadata import COORDINATOR_METADATA
from lockstep.wire import plan_to_proto, report_from_proto

HELD_STEP = 5
OLD_PLAN = Plan(step=HELD_STEP + 1, flush_prefix_cache=True)  # unlike the new coordinator's plan for that step
SETTLE_S = 10.0  # only a broken rank takes this long: the hooks fail the test then
TAKEOVER_HOLD_S = 0.5  # how long a slow rank holds a new stream back waiting for an Info read that never comes


class HeldEngine:
    """An engine held inside step HELD_STEP until `go` is set; records every step it carries out."""

    def __init__(self, rank: int, go: threading.Event, world_size: int = 2) -> None:
        self.rank = rank
        self.world_size = world_size
        self.go = go
        self.executed: list[int] = []
        self.entered = threading.Event()

    def info(self) -> RankInfo:
        return RankInfo(self.rank, self.world_size, "held", 4, (("full", 8),), 64, 101)

    def step(self, plan: Plan) -> Report:
        if plan.step == HELD_STEP:
            self.entered.set()
            assert self.go.wait(SETTLE_S), "never let go"
        self.executed.append(plan.step)
        return Report(plan.step, self.rank)


class Scenario:
    """Two ranks whose old streams hold step 5 in the engine and step 6 behind it, and the hooks that let
    them go at a chosen moment of the coordinator's `connect`."""

    def __init__(self, release_after_open: bool, hold_at_gate: bool = False) -> None:
        self.go = threading.Event()
        self.gate_go = threading.Event()
        self.at_gate = [threading.Event(), threading.Event()]
        self.release_after_open = release_after_open
        self.coordinator_opened = threading.Event()  # the coordinator has asked every rank for a new stream
        self.released = threading.Event()  # the old plans were let go and have settled
        self.engines = [HeldEngine(r, self.go) for r in range(2)]
        self.servicers = [_Hooked(self, r, e) for r, e in enumerate(self.engines)]
        if hold_at_gate:  # step 5 runs through; step 6 is held at the step gate instead
            self.go.set()
            for s in self.servicers:
                s._gate = _HeldGate(s._gate, self.at_gate[s.rank], self.gate_go)  # type: ignore[assignment]
        else:
            self.gate_go.set()
            for event in self.at_gate:
                event.set()
        self.servers = [RankServer(s, "127.0.0.1:0") for s in self.servicers]
        for server in self.servers:
            server.start()
            server.set_serving(True)
        self.addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        self.old_channels = [grpc.insecure_channel(a) for a in self.addresses]
        self.old_reports: list[list[int]] = [[], []]
        self.old_ended = [threading.Event(), threading.Event()]

    def start_old_streams(self) -> None:
        """This coordinator's streams before its reconnect (so named as its own: another coordinator's live
        stream would make the ranks refuse its new ones): step 5 (held in the engine) and step 6 behind it."""
        for r, channel in enumerate(self.old_channels):
            plans = iter([plan_to_proto(Plan(step=HELD_STEP)), plan_to_proto(OLD_PLAN)])
            stream = rank_pb2_grpc.RankServiceStub(channel).Step(_then_wait(plans, self.old_ended[r]), timeout=30,
                                                                 metadata=((COORDINATOR_METADATA, COORDINATOR_ID),))
            threading.Thread(target=self._read_old, args=(r, stream), daemon=True).start()
        for engine, at_gate in zip(self.engines, self.at_gate, strict=True):
            assert engine.entered.wait(SETTLE_S) and at_gate.wait(SETTLE_S)

    def _read_old(self, r: int, stream: Iterator[pb.ReportMsg]) -> None:
        try:
            for msg in stream:
                self.old_reports[r].append(report_from_proto(msg).step)
                if self.old_reports[r][-1] == OLD_PLAN.step:
                    break
        except grpc.RpcError:
            pass  # superseded: ABORTED
        finally:
            self.old_ended[r].set()

    def release(self) -> None:
        """Let the old plans go and wait until each old stream has run step 6 or ended without it."""
        if self.released.is_set():
            return
        self.go.set()
        self.gate_go.set()
        for ended in self.old_ended:
            assert ended.wait(SETTLE_S), "an old stream neither ran its last plan nor ended"
        self.released.set()

    def after_info(self, rank: int) -> None:
        """Called on the rank's Info handler after it computed its reply, before the reply leaves."""
        if rank == len(self.servicers) - 1 and (not self.release_after_open or self.coordinator_opened.is_set()):
            self.release()

    def close(self) -> None:
        self.go.set()
        self.gate_go.set()
        for channel in self.old_channels:
            channel.close()
        for server in self.servers:
            server.stop(grace=0.2)


class _Hooked(RankServicer):
    """The real servicer with two hooks: one after each Info reply is computed, and (when the scenario lets
    old plans go only once the coordinator has opened its streams) a rank slow to take over a new stream."""

    def __init__(self, scenario: Scenario, rank: int, engine: HeldEngine) -> None:
        super().__init__(rank, engine)
        self.scenario = scenario

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.RankInfo:
        reply = super().Info(request, context)
        self.scenario.after_info(self.rank)
        return reply

    def Step(self, request_iterator: Iterator[pb.PlanMsg], context: grpc.ServicerContext) -> Iterator[pb.ReportMsg]:
        if self.scenario.release_after_open and self.scenario.coordinator_opened.is_set():
            # the new stream arrives but the rank takes it over late: after an Info read, if one comes first
            self.scenario.released.wait(TAKEOVER_HOLD_S)
        yield from super().Step(request_iterator, context)


class _HeldGate:
    """The rank's real StepGate, holding the old stream's step 6 at its door: the old stream has already seen
    that it is current, and the plan has not started."""

    def __init__(self, gate: StepGate, arrived: threading.Event, go: threading.Event) -> None:
        self.gate = gate
        self.arrived = arrived
        self.go = go

    @property
    def last_step(self) -> int:
        return self.gate.last_step

    def deliver(self, plan: Plan, run: Callable[[Plan], Report], refuse: Callable[[Plan, str], Report]) -> Report:
        if plan == OLD_PLAN:
            self.arrived.set()
            assert self.go.wait(SETTLE_S), "never let go"
        return self.gate.deliver(plan, run, refuse)


def _then_wait(plans: Iterator[pb.PlanMsg], ended: threading.Event) -> Iterator[pb.PlanMsg]:
    """The old coordinator sends its plans, then keeps its side of the stream open (it is not closing it)."""
    yield from plans
    ended.wait(SETTLE_S)


async def _connect(scenario: Scenario) -> tuple[list[RankInfo], list[Report]]:
    """Connect a new coordinator, then drive the step it would drive next on every rank."""
    ranks = GroupRanks("g0", scenario.addresses, Metrics(), stall_threshold=5.0, dead_rank_timeout=10.0)
    first = ranks.links[0]
    open_first = first.open

    async def note_and_open(inbox: asyncio.Queue) -> None:  # the new streams are opened in rank order
        scenario.coordinator_opened.set()
        await open_first(inbox)

    first.open = note_and_open  # type: ignore[method-assign]
    try:
        infos = await ranks.connect(lambda why: None)
        await asyncio.to_thread(scenario.release)  # whatever was still held goes now
        step = infos[0].last_step + 1
        ranks.send(Plan(step=step), set())
        return infos, await asyncio.wait_for(ranks.gather(step), SETTLE_S)
    finally:
        await ranks.close()


@pytest.mark.parametrize(("release_after_open", "hold_at_gate"), [(False, False), (True, False), (True, True)],
                         ids=["before-takeover", "after-takeover", "held-at-the-gate"])
def test_no_old_plan_moves_a_rank_past_the_step_connect_read(release_after_open: bool, hold_at_gate: bool) -> None:
    scenario = Scenario(release_after_open, hold_at_gate)
    try:
        scenario.start_old_streams()
        infos, reports = asyncio.run(_connect(scenario))
        read = [i.last_step for i in infos]
        ran = [e.executed for e in scenario.engines]
        expected = HELD_STEP + (0 if release_after_open else 1)
        assert read == [expected, expected], f"connect read {read}, the engines ran {ran}"
        assert [s.last_step for s in scenario.servicers] == [expected + 1] * 2
        assert ran == [list(range(HELD_STEP, expected + 2))] * 2, "an old plan ran after connect read last_step"
        assert all(not r.error for r in reports), [r.error for r in reports]
    finally:
        scenario.close()


class _OlderRank(RankServicer):
    """A rank from before streams were acknowledged: it sends no initial metadata before its first report."""

    def Step(self, request_iterator: Iterator[pb.PlanMsg], context: grpc.ServicerContext) -> Iterator[pb.ReportMsg]:
        yield from super().Step(request_iterator, _Unacknowledging(context))


class _Unacknowledging:
    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def send_initial_metadata(self, metadata: object) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._context, name)


def test_a_rank_that_does_not_acknowledge_its_stream_is_still_connected_after_the_wait(monkeypatch, caplog) -> None:
    """An upgrade runs a new coordinator against older ranks for a while: they are driven, with a warning."""
    from lockstep.coordinator import group_ranks

    monkeypatch.setattr(group_ranks, "STREAM_ACK_S", 0.3)
    engine = HeldEngine(0, threading.Event(), world_size=1)
    server = RankServer(_OlderRank(0, engine), "127.0.0.1:0")
    server.start()
    server.set_serving(True)

    async def connect_and_step() -> list[Report]:
        ranks = GroupRanks("g0", [f"127.0.0.1:{server.port}"], Metrics(), stall_threshold=5.0, dead_rank_timeout=10.0)
        try:
            (info,) = await ranks.connect(lambda why: None)
            ranks.send(Plan(step=info.last_step + 1), set())
            return await asyncio.wait_for(ranks.gather(info.last_step + 1), SETTLE_S)
        finally:
            await ranks.close()

    try:
        (report,) = asyncio.run(connect_and_step())
        assert report.step == 0 and not report.error
        assert "did not acknowledge its new Step stream" in caplog.text
    finally:
        server.stop(grace=0.2)
