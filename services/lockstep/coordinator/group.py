"""One group's step loop: plan k to every rank, wait for every report k, plan k+1 from them.

This is the only place that drives a group's ranks. It owns the streams and the clock; every
decision comes from the pure Scheduler. The agreement wait is never silent: past the stall
threshold it is counted and logged with the ranks that have not answered, and past the dead-rank
timeout (or when a stream breaks) the group stops and hands its requests back to the coordinator.

The coordinator talks to a group only through the small interface at the top of `GroupRunner`
(submit, adopt, abort, load, flush); it never reaches into the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import grpc

from lockstep import wire
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.rank_link import RankLink
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import Event, Scheduler
from lockstep.coordinator.waits import AgreementWait
from lockstep.steps import Plan, RankInfo, Report

log = logging.getLogger("lockstep.group")

POLL_S = 0.25
RECONNECT_S = 1.0
STEP_LOG_LIMIT = 1 << 16


class StepTiming(NamedTuple):
    """Where one step's time went, so the coordinator's own time can be told from the wait for ranks."""

    batch: int  # chunks in the plan's batch
    plan_s: float
    send_s: float
    wait_s: float  # the agreement wait
    apply_s: float
    engine_s: float  # the slowest rank's own time for the step


def inconsistent(infos: list[RankInfo], size: int) -> str:
    """Why these ranks cannot be driven as one group now, or "" when they can."""
    for r, info in enumerate(infos):
        if info.rank != r or info.world_size != size:
            return f"address {r} is rank {info.rank} of {info.world_size}, expected rank {r} of {size}"
    steps = {i.last_step for i in infos}
    if len(steps) > 1:
        return f"the ranks stopped at different steps {sorted(steps)} (a broken group, to be recreated)"
    return ""


def one_step_behind(infos: list[RankInfo]) -> tuple[int, list[int]]:
    """(step k, the ranks at k - 1) when the others are at k, else (-1, []).

    Only a coordinator that died between writing plan k to one rank and to another leaves a group so:
    the ranks at k wait in step k's agreement collective for peers that never got plan k. Those peers
    abstain from step k, and the whole group skips it together.
    """
    steps = sorted({i.last_step for i in infos})
    if len(steps) != 2 or steps[1] != steps[0] + 1:
        return -1, []
    return steps[1], [r for r, i in enumerate(infos) if i.last_step == steps[0]]


class GroupDown(RuntimeError):
    """A rank of the group is dead: the group stops and its requests go back to the coordinator."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks


class GroupRunner:
    """Runs the step loop of one group; hands the scheduler's events to `on_events`."""

    def __init__(
        self,
        name: str,
        addresses: list[str],
        metrics: Metrics,
        on_events: Callable[[str, list[Event]], None],
        on_down: Callable[[str, list[Request], str], None],
        on_up: Callable[[str], None],
        stall_threshold: float = 5.0,
        dead_rank_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.links = [RankLink(r, a) for r, a in enumerate(addresses)]
        self.metrics = metrics
        self.on_events = on_events
        self.on_down = on_down
        self.on_up = on_up
        self.stall_threshold = stall_threshold
        self.dead_rank_timeout = dead_rank_timeout
        self.scheduler: Scheduler | None = None
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.wakeup = asyncio.Event()
        self.ready = asyncio.Event()
        self.up = False
        self.down_reason = ""
        self.step = 0
        self.flush_ranks: set[int] = set()
        self.flush_done: dict[int, asyncio.Future] = {}
        self.last_reports: list[Report] = []
        self.release_all = False
        self.capacity_tokens = 0  # tokens the smallest pool of the group holds: the most one request can use
        self.step_timings: deque[StepTiming] = deque(maxlen=STEP_LOG_LIMIT)
        self.steps_run = 0  # steps run since the group last formed: the step log's index
        self.task: asyncio.Task | None = None
        metrics.init_group(name, len(addresses))

    # ----- what the coordinator uses

    @property
    def serving(self) -> bool:
        return self.up and self.scheduler is not None

    @property
    def load(self) -> int:
        """Requests this group holds (waiting or running): what routing balances."""
        return 0 if self.scheduler is None else self.scheduler.num_waiting + self.scheduler.num_running

    def submit(self, request: Request) -> None:
        """Queue a new request; raises ValueError when this group can never serve it."""
        self._scheduler().add(request)
        self.kick()

    def adopt(self, request: Request) -> None:
        """Take over a request another group was running (recomputed here, first in line)."""
        self._scheduler().adopt(request)
        self.kick()

    def abort(self, request_id: str) -> None:
        """The client went away: its pages are released at the next step."""
        if self.scheduler is not None:
            self.scheduler.abort(request_id)
            self.kick()

    def counts(self) -> tuple[int, int]:
        """(waiting, running) requests, for the `lockstep_requests` gauge."""
        return (0, 0) if self.scheduler is None else (self.scheduler.num_waiting, self.scheduler.num_running)

    def kick(self) -> None:
        self.wakeup.set()

    def step_log(self, since: int) -> tuple[list[StepTiming], int]:
        """Timings of the steps from `since` (counted from when the group last formed) and the index after
        them; the oldest are dropped past STEP_LOG_LIMIT."""
        first = self.steps_run - len(self.step_timings)
        return list(self.step_timings)[max(0, since - first):], self.steps_run

    async def flush(self, rank: int | None) -> None:
        """Drop the prefix cache of one rank (or all): an operator's tool, carried by the next plan."""
        if rank is not None and not 0 <= rank < len(self.links):
            raise ValueError(f"group {self.name} has ranks 0..{len(self.links) - 1}, not {rank}")
        futs = [self._flush_future(r) for r in (range(len(self.links)) if rank is None else [rank])]
        self.kick()
        await asyncio.gather(*futs)

    def _flush_future(self, rank: int) -> asyncio.Future:
        self.flush_ranks.add(rank)
        fut = self.flush_done.get(rank)
        if fut is None or fut.done():
            fut = self.flush_done[rank] = asyncio.get_running_loop().create_future()
        return fut

    def _scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise GroupDown(f"group {self.name} is not serving: {self.down_reason or 'not connected yet'}")
        return self.scheduler

    # ----- lifecycle

    def start(self, make_scheduler: Callable[[list[RankInfo]], Scheduler]) -> None:
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
            self._come_up(infos)
            await self._loop()
            self.ready.clear()

    def _come_up(self, infos: list[RankInfo]) -> None:
        self.step = max(i.last_step for i in infos) + 1
        self.last_reports = []
        self.release_all = True
        self.up = True
        self.down_reason = ""
        totals = [n for i in infos for _, n in i.pools]
        self.capacity_tokens = min(totals) * infos[0].page_size if totals else 0
        self.metrics.forget_scheduler(self.name)
        self.step_timings.clear()
        self.steps_run = 0
        for link in self.links:
            self.metrics.rank_up.labels(self.name, str(link.rank)).set(1)
        log.info("group %s: %d rank(s) up, serving from step %d", self.name, len(self.links), self.step)
        self.ready.set()
        self.on_up(self.name)

    async def _connect(self) -> list[RankInfo]:
        """Wait until every rank answers as one group: all fresh, or all at the same step."""
        said = ""
        while True:
            infos, why = await self._infos()
            step, behind = one_step_behind(infos) if not why else (-1, [])
            if behind:
                await self._catch_up(step, behind)
                continue
            why = why or inconsistent(infos, len(self.links))
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

    async def _catch_up(self, step: int, behind: list[int]) -> None:
        """Have the ranks one step behind abstain from `step`, and wait (up to the dead-rank timeout) for
        their refusals; the ranks ahead then finish the step as refused too."""
        log.warning("group %s: ranks one step behind: ranks %s abstain from step %d, which the others are in "
                    "(their last coordinator died between its writes)", self.name, behind, step)
        inbox: asyncio.Queue = asyncio.Queue()
        for r in behind:
            await self.links[r].open(inbox)
            self.links[r].send(Plan(step=step, abstain=True))
        wait = AgreementWait(step, behind, time.monotonic())
        while not wait.done and not wait.dead(time.monotonic(), self.dead_rank_timeout):
            try:
                rank, item = await asyncio.wait_for(inbox.get(), POLL_S)
            except TimeoutError:
                continue
            if isinstance(item, str):
                log.warning("group %s: rank %d went away while catching up: %s", self.name, rank, item)
                return
            wait.record(item)

    async def _infos(self) -> tuple[list[RankInfo], str]:
        infos = []
        for link in self.links:
            try:
                infos.append(await link.info())
            except grpc.aio.AioRpcError as exc:
                return infos, f"rank {link.rank} at {link.address} does not answer ({exc.code().name})"
        return infos, ""

    # ----- the step loop: next plan -> exchange -> observe -> apply

    async def _loop(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work() and not self.flush_ranks and self.last_reports:
                    await self._idle()
                await self._run_step()
        except GroupDown as exc:
            self._go_down(str(exc), exc.ranks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must fail requests loudly, not leave them waiting
            log.exception("group %s step loop failed", self.name)
            self._go_down(f"group {self.name} failed: {exc}")

    async def _run_step(self) -> None:
        t0 = time.perf_counter()
        plan, flushed = self._next_plan()
        t_plan = time.perf_counter()
        self._send(plan, flushed)
        t_sent = time.perf_counter()
        reports = await self._gather(plan.step)
        t_reports = time.perf_counter()
        self._observe(plan, flushed, reports, t_reports - t_sent)
        self._apply(reports)
        t_end = time.perf_counter()
        self.metrics.step_duration.labels(self.name).observe(t_end - t0)
        self.step_timings.append(StepTiming(len(plan.batch), t_plan - t0, t_sent - t_plan, t_reports - t_sent,
                                            t_end - t_reports, max(r.timings.step_s for r in reports)))
        self.steps_run += 1
        self.step += 1

    def _next_plan(self) -> tuple[Plan, set[int]]:
        flushed = set(self.flush_ranks)
        self.flush_ranks.clear()
        plan = self.scheduler.plan(self.step, self.last_reports, flush=bool(flushed))
        if self.release_all:
            plan, self.release_all = dataclasses.replace(plan, release_all=True), False
        return plan, flushed

    def _send(self, plan: Plan, flushed: set[int]) -> None:
        """Serialize the plan once and queue it for every rank's stream writer."""
        msg = wire.plan_to_proto(plan)
        flush_msg = wire.plan_to_proto(dataclasses.replace(plan, flush_prefix_cache=True)) if flushed else msg
        for link in self.links:
            link.send(flush_msg if link.rank in flushed else msg)

    def _observe(self, plan: Plan, flushed: set[int], reports: list[Report], wait_s: float) -> None:
        """What the reports say before the scheduler reads them: flushes done, refusals, pool gauges."""
        if plan.probes:  # the prefix answers ride on this step's reports: their wait is this one
            self.metrics.agreement_wait.labels(self.name, "prefix").observe(wait_s)
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

    def _apply(self, reports: list[Report]) -> None:
        events = self.scheduler.apply(reports)
        self.metrics.export_scheduler_stats(self.name, self.scheduler.stats)
        self.on_events(self.name, events)

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
                    stalled = await self._check_wait(wait, stalled)
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

    async def _check_wait(self, wait: AgreementWait, stalled: bool) -> bool:
        """A wait that has gone on too long: counted and logged once past the stall threshold, and the
        group goes down past the dead-rank timeout. Returns whether the wait is counted as stalled."""
        now = time.monotonic()
        if not stalled and wait.stalled(now, self.stall_threshold):
            missing = wait.missing()
            silent = [r for r in missing if not await self.links[r].responsive()]
            log.warning("group %s step %d: agreement wait stalled for %.1f s; ranks not answered: %s; "
                        "not responding at all: %s", self.name, wait.step, now - wait.started_at, missing, silent)
            self.metrics.agreements_stalled.labels(self.name).inc()
            self.metrics.agreement_stalls.labels(self.name).inc()
            stalled = True
        dead = wait.dead(now, self.dead_rank_timeout)
        if dead:
            raise GroupDown(f"rank(s) {dead} of group {self.name} silent for {self.dead_rank_timeout:.0f} s at "
                            f"step {wait.step}", dead)
        return stalled

    def _go_down(self, reason: str, ranks: list[int] | None = None) -> None:
        """Stop the group: the dead ranks read 0 in `lockstep_rank_up` (all of them when unknown)."""
        log.error("%s; its requests go back to the coordinator", reason)
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
            if link.rank not in dead and link.streaming:
                link.send(Plan(step=self.step + 1))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        for link in self.links:
            await link.close()
