"""The rank's Step handler runs its plans on a thread of their own: step k+1 starts while report k is sent.

grpc's sync server sends a yielded report and waits for the send before it asks the handler for the next one;
these tests drive the handler as grpc does, through a stand-in context, and hold a report "in its send" by not
asking for the next one, which real gRPC cannot be made to do on demand.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.rank import service
from lockstep.rank.service import RankServicer
from lockstep.steps import GroupBroken, Plan, RankInfo, Report
from lockstep.wire import plan_to_proto, report_from_proto


class Aborted(Exception):
    """What grpc's context.abort raises in the handler."""


class FakeContext:
    """The parts of grpc.ServicerContext the Step handler uses; `end()` is grpc ending the RPC."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def send_initial_metadata(self, metadata: tuple) -> None:
        pass

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


class GatedEngine:
    """Records each step as it starts; a step waits for `gate` (cleared: the step is in its forward)."""

    def __init__(self) -> None:
        self.started: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.executed: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def info(self) -> RankInfo:
        return RankInfo(0, 1, "gated", 4, (), 64, 101)

    def step(self, plan: Plan) -> Report:
        self.started.put(plan.step)
        assert self.gate.wait(10)
        self.executed.append(plan.step)
        return Report(plan.step, 0)


class Plans:
    """The coordinator's side of the stream: plans in, None to half-close."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def __iter__(self) -> Iterator[pb.PlanMsg]:
        return iter(self._q.get, None)

    def send(self, *steps: int) -> None:
        for step in steps:
            self._q.put(plan_to_proto(Plan(step=step)))

    def close(self) -> None:
        self._q.put(None)


def _serving(engine: GatedEngine) -> Iterator[tuple]:
    """A servicer around `engine` and one Step stream to it; afterwards every gate opens and the stream ends."""
    servicer = RankServicer(0, engine)
    plans, context = Plans(), FakeContext()
    reports = servicer.Step(iter(plans), context)
    yield engine, servicer, plans, context, reports
    engine.gate.set()
    if isinstance(engine, StagingEngine):
        engine.ahead_gate.set()
    context.end()
    plans.close()  # grpc ends the request iterator with the RPC; without this every test leaves a plan-reader
    servicer.close()


@pytest.fixture
def handler():
    yield from _serving(GatedEngine())


def _started(engine: GatedEngine, timeout: float = 10) -> int:
    return engine.started.get(timeout=timeout)


def _none_started(engine: GatedEngine, wait: float = 0.3) -> bool:
    time.sleep(wait)
    return engine.started.empty()


def test_the_next_step_starts_while_a_report_is_still_being_sent(handler):
    engine, servicer, plans, context, reports = handler
    plans.send(0, 1)
    assert report_from_proto(next(reports)).step == 0  # grpc now sends report 0 and asks for nothing meanwhile
    assert _started(engine) == 0 and _started(engine) == 1
    assert servicer.last_step == 1
    assert report_from_proto(next(reports)).step == 1
    plans.close()
    assert list(reports) == []
    assert engine.executed == [0, 1]


@pytest.mark.parametrize("how", ["handler closed", "rpc ended"])
def test_a_broken_stream_starts_no_further_plan(handler, how):
    """A report that could not be sent: grpc drops the handler (closing it), and ends the RPC."""
    engine, servicer, plans, context, reports = handler
    plans.send(0)
    next(reports)
    _started(engine)
    engine.gate.clear()
    plans.send(1, 2, 3)
    assert _started(engine) == 1  # in its forward when the stream breaks
    if how == "handler closed":
        reports.close()
    else:
        context.end()
    engine.gate.set()
    assert _none_started(engine)
    assert engine.executed == [0, 1] and servicer.last_step == 1


def test_reports_made_before_a_newer_stream_took_over_are_sent_then_the_old_one_aborts(handler):
    engine, servicer, plans, context, reports = handler
    plans.send(0)
    assert report_from_proto(next(reports)).step == 0
    plans.send(1)
    assert _started(engine) == 0 and _started(engine) == 1
    newer_plans, newer_context = Plans(), FakeContext()
    newer = servicer.Step(iter(newer_plans), newer_context)
    newer_plans.send(2)
    assert report_from_proto(next(newer)).step == 2
    plans.send(3)
    assert report_from_proto(next(reports)).step == 1
    with pytest.raises(Aborted, match="superseded"):
        next(reports)
    assert context.aborted[0] == grpc.StatusCode.ABORTED
    assert _started(engine) == 2 and _none_started(engine) and engine.executed == [0, 1, 2]
    newer_context.end()


def test_a_closed_servicer_ends_the_stream_after_the_step_in_flight(handler):
    engine, servicer, plans, context, reports = handler
    plans.send(0)
    assert report_from_proto(next(reports)).step == 0
    engine.gate.clear()
    plans.send(1, 2)
    assert _started(engine) == 0 and _started(engine) == 1
    closing = threading.Thread(target=servicer.close)
    closing.start()
    time.sleep(0.1)
    assert closing.is_alive()  # close waits for the step in flight
    engine.gate.set()
    closing.join(10)
    assert report_from_proto(next(reports)).step == 1
    with pytest.raises(Aborted, match="shutting down"):
        next(reports)
    assert context.aborted[0] == grpc.StatusCode.UNAVAILABLE
    assert _none_started(engine) and engine.executed == [0, 1]


def _first(reports: Iterator[pb.ReportMsg]) -> tuple[threading.Thread, list]:
    """A thread that asks the handler for its first report (a generator starts only then), and what it got."""
    got: list = []

    def ask() -> None:
        try:
            got.append(next(reports))
        except Exception as e:
            got.append(e)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, got


def test_a_report_that_cannot_be_encoded_ends_the_stream_from_the_handler(handler, monkeypatch):
    """The handler encodes the reports it sends: its failure ends the stream as a failed send does, after at
    most the step already started."""
    engine, servicer, plans, context, reports = handler

    def broken(report: Report) -> pb.ReportMsg:
        raise ValueError("cannot encode")

    monkeypatch.setattr(service, "report_to_proto", broken)
    plans.send(0, 1)  # a coordinator with overlap sends plan k + 1 before it has report k, never k + 2
    asking, got = _first(reports)
    asking.join(10)
    assert isinstance(got[0], ValueError) and "cannot encode" in str(got[0])
    assert _started(engine) == 0
    plans.send(2)
    time.sleep(0.3)
    assert engine.executed in ([0], [0, 1])


def test_a_failure_parsing_a_plan_ends_the_stream_in_its_turn(handler, monkeypatch):
    """An exception that is no WireError (a bug) ends the stream from the handler once the plans before it are
    answered, as when the step thread parsed its plans itself."""
    engine, servicer, plans, context, reports = handler
    parse = service.plan_from_proto

    def failing(msg: pb.PlanMsg) -> Plan:
        if msg.step == 1:
            raise KeyError("no such field")
        return parse(msg)

    monkeypatch.setattr(service, "plan_from_proto", failing)
    plans.send(0, 1, 2)
    assert report_from_proto(next(reports)).step == 0
    with pytest.raises(KeyError, match="no such field"):
        next(reports)
    assert _started(engine) == 0 and _none_started(engine) and engine.executed == [0]


def test_the_step_thread_neither_parses_plans_nor_encodes_reports(handler, monkeypatch):
    """Plan k + 1 is parsed while step k runs, and report k encoded by the handler, so on a GPU host the step
    thread goes from one step to the next with nothing of the wire's in between."""
    engine, servicer, plans, context, reports = handler
    parsed: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
    encoders: set[str] = set()
    parse, encode = service.plan_from_proto, service.report_to_proto

    def parsing(msg: pb.PlanMsg) -> Plan:
        parsed.put((msg.step, threading.current_thread().name))
        return parse(msg)

    def encoding(report: Report) -> pb.ReportMsg:
        encoders.add(threading.current_thread().name)
        return encode(report)

    monkeypatch.setattr(service, "plan_from_proto", parsing)
    monkeypatch.setattr(service, "report_to_proto", encoding)
    engine.gate.clear()
    plans.send(0)
    asking, got = _first(reports)
    assert _started(engine) == 0
    plans.send(1)
    assert parsed.get(timeout=10) == (0, "plan-reader") and parsed.get(timeout=10) == (1, "plan-reader")
    assert engine.executed == []  # plan 1 was parsed while step 0 was still in its forward
    engine.gate.set()
    asking.join(10)
    assert report_from_proto(got[0]).step == 0 and report_from_proto(next(reports)).step == 1
    assert encoders and "step-runner" not in encoders


class StagingEngine(GatedEngine):
    """An engine whose host runs ahead of its device: in each step, once `ahead_gate` opens, it calls `ahead`
    (the service hands it the next plan, if that has arrived) and then waits for `gate`, its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ahead_gate = threading.Event()
        self.ahead_gate.set()
        self.staged: list[int] = []
        self.forward_s = 0.0  # how long the "device" runs each forward after `ahead` is called
        self.breaks: set[int] = set()  # steps that break the group once their forward ran

    def stage(self, plan: Plan) -> None:
        self.staged.append(plan.step)

    def step(self, plan: Plan, ahead: Callable[[Callable[[], float]], None] | None = None) -> Report:
        self.started.put(plan.step)
        assert self.ahead_gate.wait(10)
        if ahead is not None:
            done = time.perf_counter() + self.forward_s
            ahead(lambda: max(0.0, done - time.perf_counter()))
        assert self.gate.wait(10)
        self.executed.append(plan.step)
        if plan.step in self.breaks:
            raise GroupBroken(f"step {plan.step}: the device reported a fault")
        return Report(plan.step, 0)


@pytest.fixture
def staging():
    yield from _serving(StagingEngine())


def _step_zero_in_its_forward_with_one_prepared(engine: StagingEngine, servicer: RankServicer, plans: Plans,
                                                reports: Iterator[pb.ReportMsg]) -> tuple[threading.Thread, list]:
    engine.gate.clear()
    engine.ahead_gate.clear()
    plans.send(0, 1)
    asking, got = _first(reports)
    assert _started(engine) == 0
    time.sleep(0.2)  # plan 1 read and parsed meanwhile
    engine.ahead_gate.set()
    deadline = time.monotonic() + 10
    while not engine.staged and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.staged == [1] and engine.executed == []
    return asking, got


def _take_over(servicer: RankServicer) -> tuple[Plans, FakeContext, Iterator[pb.ReportMsg], threading.Thread, list]:
    """A newer coordinator's Step stream, open and asking for its first report (it supersedes the older one)."""
    newer_plans, newer_context = Plans(), FakeContext()
    newer = servicer.Step(iter(newer_plans), newer_context)
    taking, taken = _first(newer)
    time.sleep(0.2)
    return newer_plans, newer_context, newer, taking, taken


def test_the_next_plan_is_prepared_during_the_forward_and_counts_as_started(staging):
    engine, servicer, plans, context, reports = staging
    between: list[int] = []  # last_step as each plan reaches the gate, after the step before has ended
    deliver = servicer._gate.deliver

    def delivering(plan: Plan, run: Callable, refuse: Callable) -> Report:
        between.append(servicer.last_step)
        return deliver(plan, run, refuse)

    servicer._gate.deliver = delivering
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    assert servicer.last_step == 1  # a coordinator taking over now plans step 2: step 1 will run
    engine.gate.set()
    asking.join(10)
    assert report_from_proto(got[0]).step == 0 and report_from_proto(next(reports)).step == 1
    assert engine.executed == [0, 1] and servicer.last_step == 1
    assert between == [-1, 1]  # from step 0's end to step 1's start, step 1 counted as started


def test_a_plan_that_is_not_the_next_step_is_not_prepared(staging):
    engine, servicer, plans, context, reports = staging
    plans.send(0, 2)
    assert report_from_proto(next(reports)).step == 0
    refused = report_from_proto(next(reports))
    assert "out of order" in refused.error and engine.staged == [] and engine.executed == [0]


def test_a_plan_prepared_ahead_runs_and_is_answered_though_a_newer_stream_took_over(staging):
    engine, servicer, plans, context, reports = staging
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    newer_plans, newer_context, newer, taking, taken = _take_over(servicer)
    assert servicer.last_step == 1  # what the newer coordinator reads: it plans step 2
    engine.gate.set()
    asking.join(10)
    assert report_from_proto(got[0]).step == 0 and report_from_proto(next(reports)).step == 1
    with pytest.raises(Aborted, match="superseded"):
        next(reports)
    newer_plans.send(2)
    taking.join(10)
    assert report_from_proto(taken[0]).step == 2 and engine.executed == [0, 1, 2]
    newer_context.end()


def test_a_closing_servicer_waits_for_the_plan_prepared_ahead_too(staging):
    engine, servicer, plans, context, reports = staging
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    closing = threading.Thread(target=servicer.close)
    closing.start()
    time.sleep(0.2)
    assert closing.is_alive()
    engine.gate.set()
    closing.join(10)
    assert not closing.is_alive() and engine.executed == [0, 1]


def test_a_plan_that_arrives_while_the_forward_runs_is_waited_for_and_prepared(staging):
    engine, servicer, plans, context, reports = staging
    engine.forward_s = 5.0
    engine.gate.clear()
    plans.send(0)
    asking, got = _first(reports)
    assert _started(engine) == 0
    time.sleep(0.2)  # the step thread waits in `ahead` for the next plan while the "device" runs step 0
    assert engine.staged == []
    plans.send(1)
    deadline = time.monotonic() + 4
    while not engine.staged and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.staged == [1] and engine.executed == []
    engine.gate.set()
    asking.join(10)
    assert report_from_proto(got[0]).step == 0 and report_from_proto(next(reports)).step == 1


def test_once_the_forward_is_done_the_step_waits_for_no_plan(staging):
    engine, servicer, plans, context, reports = staging
    plans.send(0)
    assert report_from_proto(next(reports)).step == 0  # no plan 1 came: the report went without waiting
    plans.send(1)
    assert report_from_proto(next(reports)).step == 1 and engine.staged == []


def test_a_newer_streams_first_plan_waits_for_the_plan_prepared_ahead_of_the_older_one(staging):
    """The newer coordinator reads last_step 1 and sends step 2 at once, while the older stream's step 0 is still
    in its forward: step 2 must run after the older stream's step 1 (prepared ahead, started), not be refused as
    out of order because it took the engine first (in a group, a refusal breaks it)."""
    engine, servicer, plans, context, reports = staging
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    newer_plans, newer_context, newer, taking, taken = _take_over(servicer)
    assert servicer.last_step == 1
    newer_plans.send(2)
    time.sleep(0.2)  # the newer stream's plan 2 waits for the engine behind step 0
    engine.gate.set()
    asking.join(10)
    taking.join(10)
    assert report_from_proto(got[0]).step == 0 and report_from_proto(next(reports)).step == 1
    second = report_from_proto(taken[0])
    assert second.step == 2 and not second.error, second.error
    assert engine.executed == [0, 1, 2]
    newer_context.end()


def test_a_closing_servicer_waits_for_the_plan_prepared_ahead_by_a_superseded_stream(staging):
    """close() ends the current stream; the older one it superseded still has step 1 prepared ahead (started):
    close returns only once that has run too, not as soon as step 0 lets go of the engine."""
    engine, servicer, plans, context, reports = staging
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    newer_plans, newer_context, newer, taking, taken = _take_over(servicer)
    closing = threading.Thread(target=servicer.close)
    closing.start()
    time.sleep(0.2)
    engine.gate.set()
    closing.join(10)
    assert not closing.is_alive() and engine.executed == [0, 1]
    newer_context.end()


def test_a_rank_of_several_torch_threads_prepares_ahead_on_its_engine_thread():
    """`lockstep rank` with --threads > 1 (the default on a GPU host: cores / world size) runs each step on its
    engine thread (rank/main.py's _OnEngineThread): plan 1 is prepared there during step 0's forward too,
    not silently never, and an engine without `stage` is still stepped with the plan alone."""
    from lockstep.rank.main import EngineThread, _OnEngineThread

    engine = StagingEngine()
    stagers: list[str] = []
    stage = engine.stage
    engine.stage = lambda plan: (stagers.append(threading.current_thread().name), stage(plan))  # type: ignore
    on_thread = _OnEngineThread(engine, EngineThread())
    servicer = RankServicer(0, on_thread)
    plans, context = Plans(), FakeContext()
    reports = servicer.Step(iter(plans), context)
    try:
        asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
        assert stagers == ["engine"]
        engine.gate.set()
        asking.join(10)
        assert report_from_proto(got[0]).step == 0 and report_from_proto(next(reports)).step == 1
    finally:
        engine.gate.set()
        engine.ahead_gate.set()
        context.end()
        servicer.close()
    plain = _OnEngineThread(GatedEngine(), EngineThread())
    assert not hasattr(plain, "stage") and plain.step(Plan(0)).step == 0


def test_a_newer_stream_that_resends_the_plan_prepared_ahead_is_answered_from_its_report(staging):
    """A coordinator that reconnects while step 1 is prepared ahead (last_step 1) and resends plan 1 gets its
    report again: step 1 runs once, the very plan prepared (Engine.step breaks the rank on any other object)."""
    engine, servicer, plans, context, reports = staging
    ran, staged = [], []
    step, stage = engine.step, engine.stage
    engine.step = lambda plan, ahead=None: (ran.append(plan), step(plan, ahead))[1]  # type: ignore[method-assign]
    engine.stage = lambda plan: (staged.append(plan), stage(plan))[1]  # type: ignore[method-assign]
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    newer_plans, newer_context, newer, taking, taken = _take_over(servicer)
    newer_plans.send(1)
    time.sleep(0.2)
    engine.gate.set()
    asking.join(10)
    taking.join(10)
    again = report_from_proto(taken[0])
    assert again.step == 1 and not again.error, again.error
    assert engine.executed == [0, 1] and ran[1] is staged[0]
    newer_context.end()


def test_a_plan_of_a_stream_superseded_before_the_forward_looked_for_it_is_not_prepared(staging):
    """Plan 1 arrived, but a newer stream took over before step 0's `ahead` came to it: the newer coordinator
    read last_step 0 and plans step 1 itself, so the older plan 1 is neither prepared nor run."""
    engine, servicer, plans, context, reports = staging
    engine.gate.clear()
    engine.ahead_gate.clear()
    plans.send(0, 1)
    asking, got = _first(reports)
    assert _started(engine) == 0
    time.sleep(0.2)
    newer_plans, newer_context, newer, taking, taken = _take_over(servicer)
    assert servicer.last_step == 0
    engine.ahead_gate.set()
    engine.gate.set()
    asking.join(10)
    assert report_from_proto(got[0]).step == 0 and engine.staged == []
    newer_plans.send(1)
    taking.join(10)
    assert report_from_proto(taken[0]).step == 1 and engine.executed == [0, 1]
    newer_context.end()


def test_a_plan_prepared_ahead_of_a_step_that_broke_the_group_is_answered_without_running(staging):
    """The rank is going down (its group is made anew): running the plan would only wait in a collective its
    peers never enter, until the collective timeout, and hold the rank's exit (close waits for it) as long."""
    engine, servicer, plans, context, reports = staging
    fatal: list[str] = []
    servicer._on_fatal = fatal.append
    engine.breaks.add(0)
    asking, got = _step_zero_in_its_forward_with_one_prepared(engine, servicer, plans, reports)
    engine.gate.set()
    asking.join(10)
    assert "device reported a fault" in report_from_proto(got[0]).error and fatal
    after = report_from_proto(next(reports))
    assert after.step == 1 and "group broke" in after.error
    assert engine.executed == [0]  # the engine never ran step 1
    plans.send(2)
    assert "group broke" in report_from_proto(next(reports)).error and engine.executed == [0]
