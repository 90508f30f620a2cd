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
RECONNECT_S = 1.0


def _inconsistent(infos: list[rank_pb2.RankInfo], size: int) -> str:
    """Why these ranks cannot be driven as one group now, or "" when they can."""
    for r, info in enumerate(infos):
        if info.rank != r or info.world_size != size:
            return f"address {r} is rank {info.rank} of {info.world_size}, expected rank {r} of {size}"
    steps = {i.last_step for i in infos}
    if len(steps) > 1:
        return f"the ranks stopped at different steps {sorted(steps)} (a broken group, to be recreated)"
    return ""


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
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.info: rank_pb2.RankInfo | None = None

    async def responsive(self, timeout: float = 1.0) -> bool:
        """Whether the rank's process answers at all: a rank blocked in a collective still does, a stopped
        or hung process does not. This tells the operator which rank holds the others up."""
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def open(self, inbox: asyncio.Queue) -> None:
        """A new Step stream (the rank ends any older one) whose reports go to `inbox`."""
        if self.call is not None:
            self.call.cancel()
        for task in self.tasks:
            task.cancel()
        self.call = self.stub.Step()
        self.outbox = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._read(inbox)), loop.create_task(self._write(self.call, self.outbox, inbox))]

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

    async def _write(self, call, outbox: asyncio.Queue, inbox: asyncio.Queue) -> None:
        """Write queued plans in order, off the step loop: the loop waits for reports, not for writes."""
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            return
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError) as exc:
            await inbox.put((self.rank, f"its stream broke while sending: {exc}"))

    def send(self, plan: Plan | rank_pb2.PlanMsg) -> None:
        self.outbox.put_nowait(plan if isinstance(plan, rank_pb2.PlanMsg) else wire.plan_to_proto(plan))

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
        metrics: Metrics,
        on_events: Callable[[list], None],
        on_down: Callable[[str, list, str], None],
        stall_threshold: float = 5.0,
        dead_rank_timeout: float = 30.0,
        on_up: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.on_up = on_up
        self.links = [RankLink(r, a) for r, a in enumerate(addresses)]
        self.scheduler: Scheduler | None = None
        self.metrics = metrics
        self.on_events = on_events
        self.on_down = on_down
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
        self.release_all = False
        self.capacity_tokens = 0  # tokens the smallest pool of the group holds: the most one request can use
        self.ready = asyncio.Event()
        self.task: asyncio.Task | None = None
        metrics.init_group(name, len(addresses))

    def start(self, make_scheduler: Callable[[list[rank_pb2.RankInfo]], Scheduler]) -> None:
        """Serve this group for the coordinator's lifetime: connect, step until a rank dies, then wait
        for a whole group at the same addresses (the operator recreates it) and serve it afresh."""
        self.make_scheduler = make_scheduler
        self.task = asyncio.get_running_loop().create_task(self._lifecycle())

    async def _lifecycle(self) -> None:
        while True:
            infos = await self._connect()
            try:
                self.scheduler = self.make_scheduler(infos)
            except ValueError as exc:
                self.down_reason = f"group {self.name} cannot be served: {exc}"
                log.error("%s; retrying in %d s", self.down_reason, RECONNECT_S * 10)
                await asyncio.sleep(RECONNECT_S * 10)
                continue
            self.step = max(i.last_step for i in infos) + 1
            self.last_reports = []
            self.release_all = True
            self.up = True
            self.down_reason = ""
            for link in self.links:
                self.metrics.rank_up.labels(self.name, str(link.rank)).set(1)
            log.info("group %s: %d rank(s) up, serving from step %d", self.name, len(self.links), self.step)
            self.ready.set()
            if self.on_up is not None:
                self.on_up(self.name)
            await self._loop()
            self.ready.clear()

    async def _connect(self) -> list[rank_pb2.RankInfo]:
        """Wait until every rank answers as one group: all fresh, or all at the same step."""
        said = ""
        while True:
            why, infos = "", []
            for link in self.links:
                try:
                    infos.append(await link.stub.Info(rank_pb2.InfoRequest(), timeout=2))
                except grpc.aio.AioRpcError as exc:
                    why = f"rank {link.rank} at {link.address} does not answer ({exc.code().name})"
                    break
            if not why:
                why = _inconsistent(infos, len(self.links))
            if not why:
                break
            if why != said:
                log.info("group %s: waiting for its ranks: %s", self.name, why)
                said = why
                if not self.up:
                    self.down_reason = self.down_reason or why
            await asyncio.sleep(RECONNECT_S)
        self.inbox = asyncio.Queue()
        for link in self.links:
            await link.open(self.inbox)
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
            fut = self.flush_done.get(r)
            if fut is None or fut.done():
                fut = asyncio.get_running_loop().create_future()
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
                    await self._idle()
                t0 = time.perf_counter()
                flushed = set(self.flush_ranks)
                self.flush_ranks.clear()
                plan = self.scheduler.plan(self.step, self.last_reports, flush=bool(flushed))
                if self.release_all:
                    plan, self.release_all = dataclasses.replace(plan, release_all=True), False
                t_plan = time.perf_counter()
                self._send(plan, flushed)
                t_sent = time.perf_counter()
                reports = await self._gather(plan.step)
                t_reports = time.perf_counter()
                if plan.probes:  # the prefix answers ride on this step's reports: their wait is this one
                    self.metrics.agreement_wait.labels(self.name, "prefix").observe(t_reports - t_sent)
                for r in flushed:
                    fut = self.flush_done.pop(r, None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                self.last_reports = reports
                refused = [r for r in reports if r.error]
                if plan.release_all and refused:
                    self.release_all = True  # the ranks may still hold what another coordinator left
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

    def _send(self, plan: Plan, flushed: set[int]) -> None:
        """Serialize the plan once and queue it for every rank's stream writer."""
        msg = wire.plan_to_proto(plan)
        flush_msg = wire.plan_to_proto(dataclasses.replace(plan, flush_prefix_cache=True)) if flushed else msg
        for link in self.links:
            link.send(flush_msg if link.rank in flushed else msg)

    async def _idle(self) -> None:
        """Wait for work, but notice a rank whose stream breaks meanwhile (an idle group is watched too)."""
        self.wakeup.clear()
        woken = asyncio.ensure_future(self.wakeup.wait())
        try:
            while not woken.done():
                got = asyncio.ensure_future(self.inbox.get())
                await asyncio.wait({woken, got}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    break
                rank, item = got.result()
                if isinstance(item, str):
                    raise GroupDown(f"rank {rank} of group {self.name} is down: {item}", [rank])
        finally:
            woken.cancel()

    async def _gather(self, step: int) -> list[Report]:
        wait = AgreementWait(step, list(range(len(self.links))), time.monotonic())
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
                wait.record(item)  # a duplicate or a stale step's report is ignored, never waited for again
        finally:
            if stalled:
                self.metrics.agreements_stalled.labels(self.name).dec()
                log.warning("group %s step %d: every rank answered after %.1f s", self.name, step,
                            time.monotonic() - wait.started_at)
        self.metrics.agreement_wait.labels(self.name, "step").observe(time.perf_counter() - t0)
        return wait.reports()

    def _go_down(self, reason: str, ranks: list[int] | None = None) -> None:
        """Stop the group: the dead ranks read 0 in `lockstep_rank_up` (all of them when unknown)."""
        log.error("%s; failing its requests", reason)
        self.up = False
        self.down_reason = reason
        for rank in range(len(self.links)) if ranks is None else ranks:
            self.metrics.rank_up.labels(self.name, str(rank)).set(0)
        if ranks:
            self._poke_survivors(ranks)
        for fut in self.flush_done.values():
            if not fut.done():
                fut.set_exception(GroupDown(reason))
        self.flush_done.clear()
        self.flush_ranks.clear()
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            scheduler.requeue_all()
            self.on_down(self.name, list(scheduler.requests.values()), reason)

    def _poke_survivors(self, dead: list[int]) -> None:
        """Send the ranks still up one empty plan. Its agreement collective cannot complete without the
        dead peer, so each survivor finds its group broken and exits, and the group can be recreated
        as a whole, instead of idling on at a step no new peer will ever reach."""
        for link in self.links:
            if link.rank not in dead and link.call is not None:
                link.send(Plan(step=self.step + 1))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for link in self.links:
            await link.close()
