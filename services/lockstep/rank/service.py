"""The rank's gRPC service: plans in from one coordinator stream, carried out strictly in order, reports out.

The servicer is the only place where the network meets the engine, so it is where the step
protocol's delivery rules live:

- one plan at a time, in step order: plan k+1 is carried out only after plan k, and a plan that
  skips a step or goes back is refused (its report says which step was expected) instead of run;
  a stream's plans run on a thread of their own, so plan k+1 starts while report k is still being sent
  (grpc's sync server sends each report before it asks the handler for the next), and none starts once
  the stream broke; that thread only runs steps: plan k+1 is parsed by the thread that reads it, and report
  k serialized by the handler that sends it, both while step k+1 (or k) runs;
- an engine whose device runs ahead of the host (`Engine.stage`) prepares plan k+1 during step k's forward
  once it has arrived; from then on plan k+1 counts as started (`last_step`), so it runs even if a newer
  stream takes over, and `close` waits for it too;
- every plan gets exactly one report, even a refused one, so the coordinator's agreement wait
  always ends;
- a plan delivered twice (a coordinator that resends after a reconnect) is answered again from
  the last report and never executed twice: executing it twice would pin its prefixes twice
  (the step order and the answer to a repeat are `steps.StepGate`'s, which LocalGroup keeps too);
- an engine exception becomes `Report.error` and the stream goes on; the coordinator decides;
- a newer Step stream of the same coordinator supersedes the older one, which ends ABORTED after the step it
  is in; no plan of the older stream starts once the newer one is acknowledged (its initial metadata), so a
  coordinator that opens its streams, waits for that and then reads `Info.last_step` plans from a step no old
  plan moves;
- another coordinator's stream (`COORDINATOR_METADATA`) is refused FAILED_PRECONDITION while the one
  driving the rank keeps its stream: two coordinators taking a group from each other would interleave their
  plans and break it. A coordinator that dies ends its stream; one cut off by the network is found by the
  server's keepalive (`KEEPALIVE_MS`), after which another may take over;
- with a group token (`rank_auth`), a call without it is refused UNAUTHENTICATED before it gets here, so
  only the token's holder can supersede the coordinator's stream; the health check stays open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import replace
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lockstep.grpc_options import add_port, server_options
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep.rank.step_stream import StepStream
from lockstep.rank_auth import RankServerAuth, TokenInterceptor
from lockstep.steps import GroupBroken, Plan, RankInfo, Report, StepGate
from lockstep.stream_metadata import COORDINATOR_METADATA, STREAM_TAKEN_METADATA
from lockstep.wire import WireError, info_to_proto, plan_from_proto, report_to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RankService"].full_name
MAX_MESSAGE = 64 << 20  # a plan carries a whole prefill chunk and a long prompt's probe keys


class StepEngine(Protocol):
    """What the servicer needs of an engine: carry out one plan, and say what it serves."""

    def step(self, plan: Plan) -> Report: ...

    def info(self) -> RankInfo: ...


STREAM_METADATA = (STREAM_TAKEN_METADATA,)  # sent once this stream owns the rank
# A coordinator whose connection went silent (cut off, or its process stopped) is dropped after a ping
# unanswered for KEEPALIVE_MS, KEEPALIVE_MS after the last: its Step stream ends, and another may take over.
KEEPALIVE_MS = 10_000
REFUSAL_LOG_S = 60.0  # a coordinator refused again and again is logged once a minute


class _Superseded(Exception):
    """A plan of a stream that a newer one superseded before the plan could start."""


class _BadPlan:
    """A message that is no plan (`WireError`): the step thread refuses it in its turn, by its step number."""

    def __init__(self, msg: pb.PlanMsg, error: WireError) -> None:
        self.step, self.error = msg.step, error


def _parsed(msg: pb.PlanMsg) -> Plan | _BadPlan | BaseException:
    """The plan, or why it is none; an exception that is no WireError (a bug) goes to the step thread, which
    ends the stream with it in order, as if it had parsed the plan itself."""
    try:
        return plan_from_proto(msg)
    except WireError as e:
        return _BadPlan(msg, e)
    except Exception as e:
        return e


class RankServicer(rank_pb2_grpc.RankServiceServicer):
    """RankService over an engine with one method, `step(plan) -> report`."""

    def __init__(
        self, rank: int, engine: StepEngine | None = None, on_fatal: Callable[[str], None] | None = None
    ) -> None:
        self.rank = rank
        self._engine = engine
        self._on_fatal = on_fatal
        self._execute_lock = threading.Lock()
        self._streams_lock = threading.Lock()
        self._current: StepStream | None = None
        self._closed = False
        self._gate = StepGate(rank)
        self._in_flight: int | None = None
        self._refused: tuple[str, float] = ("", -REFUSAL_LOG_S)  # the last coordinator refused, and when logged
        self._broken = ""  # why the group broke, once it did: no plan runs after that (the rank is going down)

    def attach(self, engine: StepEngine) -> None:
        """Hand over the engine once it is loaded; until then Step and Info answer UNAVAILABLE."""
        self._engine = engine

    @property
    def last_step(self) -> int:
        """The last step carried out or being carried out now, -1 before the first: a coordinator that
        (re)connects plans the step after it, never a step the rank is already running."""
        with self._streams_lock:  # a plan either started before a newer stream took over, or never starts
            if self._in_flight is not None:
                return self._in_flight
            return self._gate.last_step

    def close(self) -> None:
        """End every stream after the step it is in, and refuse new ones: the rank is going away."""
        with self._streams_lock:
            self._closed = True
            current, self._current = self._current, None
        if current is not None:
            current.stop(grpc.StatusCode.UNAVAILABLE, f"rank {self.rank} is shutting down")
        with self._execute_lock:  # wait for the step in flight, if any, and any prepared ahead (under one hold)
            pass

    def execute(self, plan: Plan) -> Report:
        """Carry out one plan under the delivery rules above; always returns its report."""
        with self._execute_lock:
            return self._execute(plan)

    def _execute(self, plan: Plan, stream: StepStream | None = None) -> Report:
        try:
            return self._gate.deliver(plan, lambda p: self._run(p, stream), self._refuse)
        finally:  # only once the gate holds the plan as the last one carried out; a plan prepared ahead is started
            staged = stream.staged if stream is not None else None
            self._in_flight = staged.step if staged is not None else None

    def _run(self, plan: Plan, stream: StepStream | None = None) -> Report:
        """The engine's step; an exception becomes the report's error. The report carries this call's time.

        Whether `stream` is still current and the step's start are one atomic move under the streams lock:
        `last_step` (read under it) then either counts this plan or a newer stream has made sure it never runs."""
        t0 = time.perf_counter()
        with self._streams_lock:
            staged = stream is not None and plan is stream.staged
            if stream is not None and stream.end is not None and not staged:
                raise _Superseded()
            if staged:
                stream.staged = None
            self._in_flight = plan.step
        if self._broken:  # its collectives would wait for peers that are gone, and hold the rank's exit as long
            return Report(step=plan.step, rank=self.rank, error=f"rank {self.rank}: not run: its group broke "
                                                                 f"({self._broken})")
        try:
            stage = getattr(self._engine, "stage", None) if stream is not None else None
            report = (self._engine.step(plan, lambda busy: self._stage_next(stream, plan, busy)) if stage is not None
                      else self._engine.step(plan))
            if report.step != plan.step or report.rank != self.rank:
                raise RuntimeError(
                    f"engine answered plan {plan.step} with a report of step {report.step}"
                    f" from rank {report.rank}"
                )
        except Exception as e:
            report = Report(step=plan.step, rank=self.rank, error=f"{type(e).__name__}: {e}")
            self._failed(plan.step, e)
        return replace(report, timings=replace(report.timings, rank_step_s=time.perf_counter() - t0))

    def _failed(self, step: int, e: Exception) -> None:
        """Say a step's failure; a broken group is said once, by `_on_fatal`: an error, or a warning where the rank
        was told to stop and its peers went first (a Ctrl-C under load), which is no fault."""
        broken = isinstance(e, GroupBroken)
        level = logging.DEBUG if broken and self._on_fatal is not None else logging.ERROR
        log.log(level, "rank %d: step %d failed", self.rank, step, exc_info=e)
        if broken:
            self._broken = str(e)
            if self._on_fatal is not None:
                self._on_fatal(str(e))

    def _stage_next(self, stream: StepStream, current: Plan, busy: Callable[[], float]) -> None:
        """Called by the engine while the device runs `current`'s forward: the stream's next plan, once it
        arrives while the forward still runs (`busy`: how long to wait before asking it again, 0 once done), is
        the step after, is prepared now (`stage`), and from here on counts as started (`last_step` says so, and it
        runs even if a newer stream takes over): its prepare cannot be taken back."""
        try:
            plan = stream.peek()
            while plan is None and (wait := busy()) > 0:
                plan = stream.peek(wait)
            if not isinstance(plan, Plan) or plan.step != current.step + 1:
                return
            with self._streams_lock:
                if stream.end is not None:
                    return
                stream.staged = plan
                self._in_flight = plan.step
            self._engine.stage(plan)  # type: ignore[union-attr]  # `_run` asks only an engine that has it
        except Exception:  # the engine prepares it in its step instead; the step in flight goes on
            log.exception("rank %d: preparing step %d ahead failed", self.rank, current.step + 1)

    def _refuse(self, plan: Plan | _BadPlan, why: str) -> Report:
        """Answer a plan without running it. In a group of several ranks the peers may be running it, and
        would wait in its collectives for this rank forever: the group is broken, so the rank exits."""
        log.error("rank %d: refusing plan %d: %s", self.rank, plan.step, why)
        if self._on_fatal is not None and self._world_size() > 1:
            self._on_fatal(f"plan {plan.step} cannot be carried out here ({why}) while the peers may run it")
        return Report(step=plan.step, rank=self.rank, error=why)

    def _world_size(self) -> int:
        try:
            return self._engine.info().world_size if self._engine is not None else 1
        except Exception:
            return 1

    def _open(self, context: grpc.ServicerContext) -> StepStream:
        if self._engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rank {self.rank} is still loading its engine")
        coordinator = dict(context.invocation_metadata()).get(COORDINATOR_METADATA, "")
        stream = StepStream(coordinator, context.peer())
        with self._streams_lock:
            if self._closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"rank {self.rank} is shutting down")
            old = self._current
            holder = old if old is not None and old.live() and old.coordinator != coordinator else None
            if holder is None:
                self._current = stream
                if old is not None:  # under the lock: no plan of the old stream starts after this
                    old.stop(grpc.StatusCode.ABORTED, "superseded by a newer Step stream to this rank")
        if holder is not None:
            self._refuse_coordinator(context, stream, holder)
        if old is not None:
            log.warning("rank %d: a new Step stream supersedes the old one", self.rank)
        try:
            context.send_initial_metadata(STREAM_METADATA)
        except BaseException:  # the call ended before it was taken: its coordinator cancelled it or went away
            stream.reading = False
            raise
        return stream

    def _refuse_coordinator(self, context: grpc.ServicerContext, stream: StepStream, holder: StepStream) -> None:
        """Abort a second coordinator's stream, saying which one drives the rank (logged once a minute each)."""
        why = (f"rank {self.rank} is driven by another coordinator ({holder.coordinator or 'unnamed'} at "
               f"{holder.peer}, since {holder.since}); another may take it over only once that one's stream ends")
        last, at = self._refused
        if stream.coordinator != last or time.monotonic() - at >= REFUSAL_LOG_S:
            self._refused = (stream.coordinator, time.monotonic())
            log.warning("rank %d: refused a Step stream of coordinator %s at %s: driven by %s at %s", self.rank,
                        stream.coordinator or "(unnamed)", stream.peer, holder.coordinator or "(unnamed)",
                        holder.peer)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)

    def Step(
        self, request_iterator: Iterator[pb.PlanMsg], context: grpc.ServicerContext
    ) -> Iterator[pb.ReportMsg]:
        stream = self._open(context)
        try:
            yield from self._serve(stream, request_iterator, context)
        finally:  # however the handler ends, this stream drives the rank no more: another coordinator may
            stream.reading = False

    def _serve(self, stream: StepStream, request_iterator: Iterator[pb.PlanMsg], context: grpc.ServicerContext
               ) -> Iterator[pb.ReportMsg]:
        """Yield the step thread's reports. grpc sends a yielded report before it asks for the next one, so the
        steps run on a thread of their own (`_work`) and step k+1 starts while report k is being sent."""
        context.add_callback(lambda: stream.drop("the Step stream ended"))
        threading.Thread(
            target=stream.read, args=(request_iterator, _parsed), daemon=True, name="plan-reader"
        ).start()
        threading.Thread(target=self._work, args=(stream,), daemon=True, name="step-runner").start()
        try:
            while True:
                item = stream.outbox.get()
                if item is StepStream._ABORT:
                    context.abort(*stream.end)
                if item is StepStream._DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield report_to_proto(item)  # here, not on the step thread: it runs the next step meanwhile
        finally:  # a report that could not be sent (the stream broke): no further plan of this stream starts
            stream.drop("the Step stream's handler ended")

    def _work(self, stream: StepStream) -> None:
        """The stream's plans, carried out one after the other; their reports, then a marker, go to the outbox."""
        try:
            while True:
                item = stream.take()
                if stream.end is not None:
                    stream.outbox.put(StepStream._ABORT)
                    return
                if item is StepStream._EOF:
                    stream.outbox.put(StepStream._DONE)
                    return
                stream.outbox.put(self._carry_out(stream, item))
        except _Superseded:
            stream.outbox.put(StepStream._ABORT)
        except BaseException as e:  # the handler raises it, as if it had run the step itself
            stream.outbox.put(e)

    def _carry_out(self, stream: StepStream, plan: Plan | _BadPlan | BaseException) -> Report:
        """One plan of `stream` as its reader parsed it: refused if it did not parse; `_Superseded` once a newer
        stream owns the rank."""
        if isinstance(plan, BaseException):
            raise plan
        if isinstance(plan, _BadPlan):
            return self._refuse(plan, f"bad plan: {plan.error}")
        with self._execute_lock:
            if stream.end is not None:  # superseded while waiting: the newer stream owns the rank now
                raise _Superseded()
            report = self._execute(plan, stream)
            while stream.staged is not None:  # started: it runs next, before a newer stream's plan takes the lock
                stream.outbox.put(report)
                report = self._execute(stream.take(), stream)
            return report

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.RankInfo:
        if self._engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rank {self.rank} is still loading its engine")
        try:
            return info_to_proto(replace(self._engine.info(), last_step=self.last_step))
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, f"rank {self.rank} cannot describe itself: {e}")


class RankServer:
    """The rank's gRPC server: RankService plus grpc.health.v1, NOT_SERVING until `set_serving(True)`.

    `auth` asks callers for the group token and serves TLS when it has a certificate; without a token the
    rank serves whoever reaches its port, and says so in its log. `health_address`, when given, is a second,
    plaintext port with grpc.health.v1 alone (the same statuses): the kubelet's gRPC probes cannot speak TLS,
    and a port without RankService gives nothing away."""

    def __init__(self, servicer: RankServicer, address: str, max_workers: int = 8,
                 auth: RankServerAuth | None = None, health_address: str | None = None) -> None:
        auth = auth or RankServerAuth()
        self.servicer = servicer
        self.health = health.HealthServicer()
        self.health_server, self.health_port = _health_server(self.health, health_address)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rank-grpc"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                     *server_options(KEEPALIVE_MS)],
            interceptors=[TokenInterceptor(auth.token, f"rank {servicer.rank}")] if auth.token else [],
        )
        rank_pb2_grpc.add_RankServiceServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = add_port(self.server, address, "the rank's gRPC server", auth.credentials())
        if not auth.token:
            log.warning("rank %d: no group token (LOCKSTEP_GROUP_TOKEN or --group-token-file): anyone who reaches "
                        "port %d can drive this rank", servicer.rank, self.port)
        self.set_serving(False)

    def start(self) -> None:
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def stop(self, grace: float = 1.0) -> None:
        """NOT_SERVING first, then end the streams after their step, then stop the server."""
        self.set_serving(False)
        self.servicer.close()
        self.server.stop(grace).wait()
        if self.health_server is not None:
            self.health_server.stop(0).wait()


def _health_server(servicer: health.HealthServicer, address: str | None) -> tuple[grpc.Server | None, int | None]:
    """A plaintext server with `servicer` alone bound to `address` (None: no such server), and its port."""
    if address is None:
        return None, None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="rank-health"),
                         options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, add_port(server, address, "the rank's health port")
