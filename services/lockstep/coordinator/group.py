"""One group's step loop: plan k to every rank, wait for every report k, plan k+1 from them.

This is the only place that talks to a group's ranks. It owns the streams and the clock; every
decision comes from the pure Scheduler. The agreement wait is never silent: past the stall
threshold it is counted and logged with the ranks that have not answered, and past the dead-rank
timeout (or when a stream breaks) the group stops and its requests fail with a retriable error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lockstep import wire
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.scheduler import Scheduler
from lockstep.coordinator.waits import AgreementWait
from lockstep.proto_gen.lockstep.v1 import rank_pb2, rank_pb2_grpc
from lockstep.steps import Plan, Report

log = logging.getLogger("lockstep.group")

POLL_S = 0.25


class GroupDown(RuntimeError):
    """A rank of the group is dead: the group stops and its requests fail with a retriable error."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks


class RankLink:
    """The coordinator's end of one rank's Step stream."""

    def __init__(self, rank: int, address: str) -> None:
        self.rank = rank
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = rank_pb2_grpc.RankServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.call = None
        self.info: rank_pb2.RankInfo | None = None

    async def wait_info(self, deadline: float) -> rank_pb2.RankInfo:
        """Ask the rank what it serves, retrying while it is still loading."""
        while True:
            try:
                self.info = await self.stub.Info(rank_pb2.InfoRequest(), timeout=5)
                return self.info
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise GroupDown(f"rank {self.rank} at {self.address} is not reachable: {exc.details()}") from exc
                await asyncio.sleep(0.2)

    async def responsive(self, timeout: float = 1.0) -> bool:
        """Whether the rank's process answers at all: a rank blocked in a collective still does, a stopped
        or hung process does not. This tells the operator which rank holds the others up."""
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def open(self, inbox: asyncio.Queue) -> None:
        self.call = self.stub.Step()
        asyncio.get_running_loop().create_task(self._read(inbox))

    async def _read(self, inbox: asyncio.Queue) -> None:
        try:
            async for msg in self.call:
                await inbox.put((self.rank, wire.report_from_proto(msg)))
            reason = "its stream ended"
        except grpc.aio.AioRpcError as exc:
            reason = f"its stream broke: {exc.code().name} {exc.details()}"
        except asyncio.CancelledError:
            return
        await inbox.put((self.rank, reason))

    async def send(self, plan: Plan) -> None:
        await self.call.write(wire.plan_to_proto(plan))

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        await self.channel.close()


class GroupRunner:
    """Runs the step loop of one group and hands the scheduler's events to `on_events`."""

    def __init__(
        self,
        name: str,
        addresses: list[str],
        scheduler: Scheduler,
        metrics: Metrics,
        on_events: Callable[[list], None],
        stall_threshold: float = 5.0,
        dead_rank_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.links = [RankLink(r, a) for r, a in enumerate(addresses)]
        self.scheduler = scheduler
        self.metrics = metrics
        self.on_events = on_events
        self.stall_threshold = stall_threshold
        self.dead_rank_timeout = dead_rank_timeout
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.wakeup = asyncio.Event()
        self.up = False
        self.down_reason = ""
        self.step = 0
        self.flush_ranks: set[int] = set()
        self.flush_done: dict[int, asyncio.Future] = {}
        self.last_reports: list[Report] = []
        self.task: asyncio.Task | None = None
        metrics.init_group(name, len(addresses))

    async def start(self, connect_timeout: float = 600.0) -> list[rank_pb2.RankInfo]:
        deadline = time.monotonic() + connect_timeout
        infos = [await link.wait_info(deadline) for link in self.links]
        for link in self.links:
            await link.open(self.inbox)
            self.metrics.rank_up.labels(self.name, str(link.rank)).set(1)
        self.up = True
        self.task = asyncio.get_running_loop().create_task(self._loop())
        return infos

    def kick(self) -> None:
        self.wakeup.set()

    async def flush(self, rank: int | None) -> None:
        """Drop the prefix cache of one rank (or all): an operator's tool, carried by the next plan."""
        ranks = range(len(self.links)) if rank is None else [rank]
        if rank is not None and not 0 <= rank < len(self.links):
            raise ValueError(f"group {self.name} has ranks 0..{len(self.links) - 1}, not {rank}")
        futs = []
        for r in ranks:
            self.flush_ranks.add(r)
            fut = self.flush_done.get(r) or asyncio.get_running_loop().create_future()
            self.flush_done[r] = fut
            futs.append(fut)
        self.kick()
        await asyncio.gather(*futs)

    async def _loop(self) -> None:
        # Per step: (chunks in the batch, plan s, send s, agreement wait s, apply s, slowest rank's engine s),
        # so the coordinator's own time can be told apart from the wait for ranks (read by `lockstep bench`).
        self.step_timings: deque[tuple[int, float, float, float, float, float]] = deque(maxlen=1 << 16)
        try:
            while True:
                if not self.scheduler.has_work() and not self.flush_ranks and self.last_reports:
                    self.wakeup.clear()
                    await self.wakeup.wait()
                t0 = time.perf_counter()
                flushed = set(self.flush_ranks)
                self.flush_ranks.clear()
                plan = self.scheduler.plan(self.step, self.last_reports, flush=bool(flushed))
                t_plan = time.perf_counter()
                for link in self.links:
                    rank_plan = dataclasses.replace(plan, flush_prefix_cache=True) if link.rank in flushed else plan
                    await link.send(rank_plan)
                t_sent = time.perf_counter()
                reports = await self._gather(plan.step)
                t_reports = time.perf_counter()
                for r in flushed:
                    fut = self.flush_done.pop(r, None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                self.last_reports = reports
                refused = [r for r in reports if r.error]
                if refused:
                    log.error("group %s step %d refused by the ranks (a coordinator bug if admission allowed it): %s",
                              self.name, plan.step, "; ".join(f"rank {r.rank}: {r.error}" for r in refused))
                self.metrics.observe_pools(self.name, {r.rank: r.pools for r in reports})
                self.on_events(self.scheduler.apply(reports))
                t_end = time.perf_counter()
                self.metrics.step_duration.labels(self.name).observe(t_end - t0)
                engine_s = max(r.timings.get("step_s", 0.0) for r in reports)
                self.step_timings.append((len(plan.batch), t_plan - t0, t_sent - t_plan, t_reports - t_sent,
                                          t_end - t_reports, engine_s))
                self.step += 1
        except GroupDown as exc:
            self._go_down(str(exc), exc.ranks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must fail requests loudly, not leave them waiting
            log.exception("group %s step loop failed", self.name)
            self._go_down(f"group {self.name} failed: {exc}")

    async def _gather(self, step: int) -> list[Report]:
        wait = AgreementWait(step, list(range(len(self.links))), time.monotonic())
        got: dict[int, Report] = {}
        stalled = False
        t0 = time.perf_counter()
        try:
            while not wait.done:
                try:
                    rank, item = await asyncio.wait_for(self.inbox.get(), POLL_S)
                except TimeoutError:
                    now = time.monotonic()
                    if not stalled and wait.stalled(now, self.stall_threshold):
                        missing = wait.missing()
                        silent = [r for r in missing if not await self.links[r].responsive()]
                        log.warning("group %s step %d: agreement wait stalled for %.1f s; ranks not answered: %s; "
                                    "not responding at all: %s", self.name, step, now - wait.started_at,
                                    missing, silent)
                        self.metrics.agreements_stalled.labels(self.name).inc()
                        self.metrics.agreement_stalls.labels(self.name).inc()
                        stalled = True
                    dead = wait.dead(now, self.dead_rank_timeout)
                    if dead:
                        raise GroupDown(f"rank(s) {dead} of group {self.name} silent for "
                                        f"{self.dead_rank_timeout:.0f} s at step {step}", dead) from None
                    continue
                if isinstance(item, str):
                    raise GroupDown(f"rank {rank} of group {self.name} is down: {item}", [rank])
                if wait.record(item):
                    got[rank] = item
        finally:
            if stalled:
                self.metrics.agreements_stalled.labels(self.name).dec()
                log.warning("group %s step %d: every rank answered after %.1f s", self.name, step,
                            time.monotonic() - wait.started_at)
        self.metrics.agreement_wait.labels(self.name, "step").observe(time.perf_counter() - t0)
        return [got[r] for r in range(len(self.links))]

    def _go_down(self, reason: str, ranks: list[int] | None = None) -> None:
        """Stop the group: the dead ranks read 0 in `lockstep_rank_up` (all of them when unknown)."""
        log.error("%s; failing its requests", reason)
        self.up = False
        self.down_reason = reason
        for rank in range(len(self.links)) if ranks is None else ranks:
            self.metrics.rank_up.labels(self.name, str(rank)).set(0)
        for fut in self.flush_done.values():
            if not fut.done():
                fut.set_exception(GroupDown(reason))
        self.on_events(self.scheduler.fail_all(reason))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for link in self.links:
            await link.close()
