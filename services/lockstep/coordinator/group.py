"""One group's step loop: plan k to every rank, wait for every report k, plan k+1 from them.

Every decision comes from the pure Scheduler; `group_ranks.py` moves plans and reports and keeps the
agreement wait honest. When a rank dies the group stops, hands its requests back to the coordinator
(`on_down`), and waits for a whole group at the same addresses (the operator, or `lockstep serve`,
recreates it) to serve afresh.

The coordinator talks to a group only through the small interface at the top of `GroupRunner`
(submit, adopt, abort, load, counts, flush, step_log); it never reaches into the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import reprlib
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from lockstep.coordinator.events import Event
from lockstep.coordinator.group_ranks import RECONNECT_S, GroupDown, GroupRanks
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.rebalance import current_split
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import Scheduler
from lockstep.kv.paging import POOL_FULL, pages_for
from lockstep.rank_auth import RankClientAuth
from lockstep.steps import Plan, RankInfo, Report

log = logging.getLogger("lockstep.group")

STEP_LOG_LIMIT = 1 << 16


class StepTiming(NamedTuple):
    """Where one step's time went, so the coordinator's own time can be told from the wait for ranks."""

    batch: int  # chunks in the plan's batch
    plan_s: float  # building and sending the plan while no step ran (0 for a plan built ahead)
    send_s: float
    wait_s: float  # the agreement wait
    apply_s: float
    engine_s: float  # the slowest rank's own time for the step
    # building and sending the next plan while this step ran (overlap; 0: none was sent, the next plan waits for
    # these reports). Then the ranks run that plan while these reports are applied, so apply_s is hidden too.
    ahead_s: float = 0.0
    # handing the step before's tokens to their clients, done once this step's plans are out (so while the ranks
    # run): the agreement wait is the rest of the time to the reports (the loop turn the writers get before it too)
    deliver_s: float = 0.0


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
        rank_auth: RankClientAuth | None = None,
        overlap: bool = True,
    ) -> None:
        self.name = name
        self.overlap = overlap  # build plan k + 1 while the ranks run step k, where the scheduler can
        self.ranks = GroupRanks(name, addresses, metrics, stall_threshold, dead_rank_timeout, rank_auth)
        self.metrics = metrics
        self.on_events = on_events
        self.on_down = on_down
        self.on_up = on_up
        self.scheduler: Scheduler | None = None
        self.wakeup = asyncio.Event()
        self.ready = asyncio.Event()
        self.up = False
        self.draining = False  # set by /admin/drain, cleared by /admin/resume; survives a recreation
        self.migrate_asked = False
        self.down_reason = ""  # for /health: what took the group down, and what it waits for now
        self.down_cause = ""  # what took it down last
        self.step = 0
        self.flush_asked: dict[int, asyncio.Future] = {}  # flushes not yet in a plan, by rank
        self.flush_sent: dict[int, asyncio.Future] = {}  # flushes in the plan in flight
        self.last_reports: list[Report] = []
        self.in_flight: Plan | None = None  # a plan sent whose reports were not taken in yet
        # the last reports' events, for their clients once the next plan is out (None: handed on)
        self.undelivered: list[Event] | None = None
        self.release_all = False
        self.capacity_tokens = 0  # tokens the smallest full pool holds: the most one request can use (0: any)
        self.page_size = 1
        self.step_timings: deque[StepTiming] = deque(maxlen=STEP_LOG_LIMIT)
        self.steps_run = 0  # steps run since the group last formed: the step log's index
        self.task: asyncio.Task | None = None
        metrics.init_group(name, len(addresses))

    # ----- what the coordinator uses

    @property
    def serving(self) -> bool:
        """Up and taking new requests (a draining group finishes what it holds but takes nothing new)."""
        return self.up and self.scheduler is not None and not self.draining

    @property
    def holds_nothing(self) -> bool:
        """No request waiting or running, and nothing left to release on the ranks."""
        return self.scheduler is None or not self.scheduler.has_work()

    async def drain(self, migrate: bool = False) -> None:
        """Take no new request; return once the group holds nothing: its requests finished or, with
        `migrate`, were handed to other groups at the next step boundary (as when it goes down)."""
        self.draining = True
        self.migrate_asked = (self.migrate_asked or migrate) and not self.holds_nothing
        self.kick()
        while not self.holds_nothing:
            await asyncio.sleep(0.05)

    def resume(self) -> None:
        """Take new requests again; a migration asked by the drain is dropped with it (else the next step would
        hand over the first requests the group takes, with no other group asked to take them)."""
        self.draining = False
        self.migrate_asked = False

    @property
    def load(self) -> int:
        """Requests this group holds (waiting or running): what routing balances."""
        return 0 if self.scheduler is None else self.scheduler.num_waiting + self.scheduler.num_running

    def cannot_hold(self, request: Request) -> str:
        """Why this group can never serve the request (its smallest pool, or its positions), or ""."""
        if self.capacity_tokens and request.max_positions > self.capacity_tokens:
            need = pages_for(request.max_positions, self.page_size)
            return (f"request {request.request_id} needs up to {need} KV pages but the smallest rank pool holds "
                    f"{self.capacity_tokens // self.page_size}")
        return "" if self.scheduler is None else self.scheduler.cannot_hold(request)

    def submit(self, request: Request) -> None:
        """Queue a new request; raises ValueError when this group can never serve it."""
        self._scheduler().add(request)
        self.kick()

    def adopt(self, requests: list[Request]) -> None:
        """Take over requests another group was running (recomputed here, ahead of new ones, oldest first)."""
        self._scheduler().adopt(requests)
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
        """Drop the prefix cache of one rank (or all): an operator's tool, carried by the next plan. Returns
        once a plan built after this call has carried the flush out."""
        if rank is not None and not 0 <= rank < len(self.ranks):
            raise ValueError(f"group {self.name} has ranks 0..{len(self.ranks) - 1}, not {reprlib.repr(rank)}")
        loop = asyncio.get_running_loop()
        futs = [self.flush_asked.setdefault(r, loop.create_future())
                for r in (range(len(self.ranks)) if rank is None else [rank])]
        self.kick()
        await asyncio.gather(*futs)

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
            infos = await self.ranks.connect(self._waiting, self._unusable)
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

    def _unusable(self, infos: list[RankInfo]) -> str:
        """Why this coordinator cannot serve these ranks (page size, model, pools), checked before it opens
        their Step streams; "" when it can."""
        try:
            self.make_scheduler(infos)
        except ValueError as exc:
            return f"group {self.name} cannot be served: {exc}"
        return ""

    def _waiting(self, why: str) -> None:
        """/health says why the group is not serving now, and what took it down last."""
        if not self.up:
            self.down_reason = f"{self.down_cause}; now: {why}" if self.down_cause else why

    def _come_up(self, infos: list[RankInfo]) -> None:
        self.step = max(i.last_step for i in infos) + 1
        self.last_reports = []
        self.in_flight = None
        self.release_all = True
        self.up = True
        self.down_reason = ""
        totals = [n for i in infos for name, n in i.pools if name == POOL_FULL]  # a window bounds no context
        self.page_size = infos[0].page_size
        self.capacity_tokens = min(totals) * self.page_size if totals else 0
        self.metrics.forget_scheduler(self.name)
        self.step_timings.clear()
        self.steps_run = 0
        for rank in range(len(self.ranks)):
            self.metrics.rank_up.labels(self.name, str(rank)).set(1)
        log.info("group %s: %d rank(s) up, serving from step %d", self.name, len(self.ranks), self.step)
        self.ready.set()
        self.on_up(self.name)

    # ----- the step loop: next plan -> exchange -> observe -> apply

    async def _loop(self) -> None:
        try:
            while True:
                if (not self.scheduler.has_work() and not self.flush_asked and self.last_reports
                        and self.in_flight is None):
                    self.migrate_asked = False  # nothing left to move
                    self.wakeup.clear()
                    self._deliver()
                    await self.ranks.idle(self.wakeup)
                await self._run_step()
        except GroupDown as exc:
            self._go_down(str(exc), exc.ranks)
        except asyncio.CancelledError:  # closed, maybe in the loop turn before a step's events were handed on
            self._deliver()  # (at the sleep(0)): their clients must still get them, or their streams hang
            raise
        except Exception as exc:  # a bug here must fail requests loudly, not leave them waiting
            log.exception("group %s step loop failed", self.name)
            self._go_down(f"group {self.name} failed: {exc}")

    async def _run_step(self) -> None:
        """One step: its plan (built now, or ahead while the last step ran), the next plan built ahead where the
        scheduler can (overlap), the agreement wait, and the reports taken in."""
        t0 = t_plan = t_sent = time.perf_counter()
        plan = self.in_flight
        if plan is None:
            plan = self._next_plan()
            t_plan = time.perf_counter()
            self.ranks.send(plan, set(self.flush_sent))
            t_sent = time.perf_counter()
        self.in_flight = self._plan_ahead(plan)
        t_ahead = time.perf_counter()
        if self.undelivered:  # the links' writers put the plans on the wire first (they run at an await)
            await asyncio.sleep(0)
        t_woke = time.perf_counter()  # that turn (the writers, whatever else ran) waits for the ranks: in wait_s
        self._deliver()  # the ranks have this plan (and the next, with overlap): clients wait, not ranks
        t_delivered = time.perf_counter()
        reports = await self.ranks.gather(plan.step)
        t_reports = time.perf_counter()
        deliver_s = t_delivered - t_woke
        wait_s = t_reports - t_ahead - deliver_s
        self._observe(plan, reports, wait_s)
        self._apply(reports)
        t_end = time.perf_counter()
        self.metrics.step_duration.labels(self.name).observe(t_end - t0)
        plan_s, send_s, ahead_s, apply_s = t_plan - t0, t_sent - t_plan, t_ahead - t_sent, t_end - t_reports
        sent_ahead = self.in_flight is not None  # then the ranks ran that plan while these reports were applied
        if not sent_ahead:  # the check that found no plan to send ahead counts as planning
            plan_s, ahead_s = plan_s + ahead_s, 0.0
        hidden = deliver_s + (ahead_s + apply_s if sent_ahead else 0.0)
        exposed = plan_s + send_s + (0.0 if sent_ahead else apply_s)
        self.metrics.coordinator_seconds.labels(self.name, "exposed").inc(exposed)
        self.metrics.coordinator_seconds.labels(self.name, "hidden").inc(hidden)
        self.step_timings.append(StepTiming(len(plan.batch), plan_s, send_s, wait_s, apply_s,
                                            max(r.timings.step_s for r in reports), ahead_s, deliver_s))
        self.steps_run += 1
        self.step += 1
        if self.migrate_asked and self.in_flight is None:  # a step boundary with nothing in flight
            self.migrate_asked = False
            self._deliver()  # the tokens these requests made here reach their clients before they move
            self.on_down(self.name, self.scheduler.hand_over(), f"group {self.name} is draining")

    def _next_plan(self) -> Plan:
        self.flush_sent, self.flush_asked = self.flush_asked, {}
        plan = self.scheduler.plan(self.step, self.last_reports, flush=bool(self.flush_sent), now=time.monotonic())
        if self.release_all:
            plan, self.release_all = dataclasses.replace(plan, release_all=True), False
        return plan

    def _plan_ahead(self, plan: Plan) -> Plan | None:
        """Send the plan after `plan` now, while the ranks run it, where the scheduler can build it without its
        reports (scheduler.plan_ahead); a flush, a migration or a first plan after (re)connecting waits."""
        if not self.overlap or self.flush_asked or self.migrate_asked or plan.release_all:
            return None
        ahead = self.scheduler.plan_ahead(plan.step + 1)
        if ahead is not None:
            self.ranks.send(ahead, set())
        return ahead

    def _observe(self, plan: Plan, reports: list[Report], wait_s: float) -> None:
        """What the reports say before the scheduler reads them: flushes done, refusals, pool gauges."""
        if plan.probes:  # the prefix answers ride on this step's reports: their wait is this one
            self.metrics.agreement_wait.labels(self.name, "prefix").observe(wait_s)
        if plan.pool_split or plan.pool_fence:
            self._observe_rebalance(plan, reports, wait_s)
        for fut in self.flush_sent.values():
            if not fut.done():
                fut.set_result(None)
        self.flush_sent = {}
        self.last_reports = reports
        refused = [r for r in reports if r.error]
        if plan.release_all and refused:
            self.release_all = True  # the ranks may still hold what another coordinator left
        if refused:
            log.error("group %s step %d refused by the ranks (a coordinator bug if admission allowed it): %s",
                      self.name, plan.step, "; ".join(f"rank {r.rank}: {r.error}" for r in refused))
        self.metrics.observe_pools(self.name, {r.rank: r.pools for r in reports})

    def _observe_rebalance(self, plan: Plan, reports: list[Report], wait_s: float) -> None:
        """A rebalance step: its agreement wait, and the split moved (on /metrics and in the log) or refused."""
        self.metrics.agreement_wait.labels(self.name, "rebalance").observe(wait_s)
        before = current_split(self.last_reports)
        after = dict(plan.pool_split)
        if any(r.error for r in reports):
            log.error("group %s: rebalance %s refused at step %d; it is not sent again", self.name,
                      after or dict(plan.pool_fence), plan.step)
            return
        if not after:
            log.info("group %s: fenced the KV pools at %s pages at step %d, for the pages held above to drain "
                     "before a rebalance", self.name, dict(plan.pool_fence), plan.step)
            return
        reason = self.scheduler.rebalancer.reason if self.scheduler.rebalancer is not None else ""
        ranks = {r.rank: {p.pool: p.total for p in r.pools} for r in self.last_reports}
        if any(totals != before for totals in ranks.values()):  # before the first split: --rank-kv-pages
            reason += "; the ranks' pools differed before it: " + ", ".join(f"rank {r} {t}" for r, t in ranks.items())
        self.metrics.observe_rebalance(self.name, before, after, reason)

    def _apply(self, reports: list[Report]) -> None:
        """Take the reports in; their events wait in `undelivered` until the next plan is written to the ranks'
        streams, so that it never waits on handing a batch of tokens to their clients (on the coordinator's
        critical path: a rank's report -> the plan after next). Clients run only once the loop awaits, which it
        does next after `_deliver`, so they get their tokens no later."""
        self._deliver()
        self.undelivered = self.scheduler.apply(reports)
        self.metrics.export_scheduler_stats(self.name, self.scheduler.stats)

    def _deliver(self) -> None:
        """`on_events` once per step applied, with or without events (the benchmark counts steps by it)."""
        events, self.undelivered = self.undelivered, None
        if events is not None:
            self.on_events(self.name, events)

    def _go_down(self, reason: str, ranks: list[int] | None = None) -> None:
        """Stop the group: the dead ranks read 0 in `lockstep_rank_up` (all of them when unknown)."""
        log.error("%s; its requests go back to the coordinator", reason)
        self._deliver()  # what the group made before it went down reaches the clients before the requests move
        self.up = False
        self.down_reason = self.down_cause = reason
        for rank in range(len(self.ranks)) if ranks is None else ranks:
            self.metrics.rank_up.labels(self.name, str(rank)).set(0)
        if ranks:
            self.ranks.poke_survivors(ranks, self.step + 1 + (self.in_flight is not None))
        self.in_flight = None
        for fut in [*self.flush_sent.values(), *self.flush_asked.values()]:
            if not fut.done():
                fut.set_exception(GroupDown(reason))
        self.flush_sent, self.flush_asked = {}, {}
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            scheduler.requeue_all()
            self.on_down(self.name, list(scheduler.requests.values()), reason)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.ranks.close()
