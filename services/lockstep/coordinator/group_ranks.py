"""A group's ranks as one: connect to all of them, send each plan to all, and wait for every report.

This is the only place that waits on ranks, so the agreement wait's promises live here: it is never
silent (past the stall threshold it is counted and logged with the ranks that have not answered, and
which of them do not answer at all), and it never lasts for ever (past the dead-rank timeout, or when a
stream breaks, the group is down). What the group then does is `group.py`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable

import grpc

from lockstep import wire
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.rank_link import COORDINATOR_ID, RankLink
from lockstep.coordinator.waits import AgreementWait
from lockstep.rank_auth import RankClientAuth
from lockstep.steps import Plan, RankInfo, Report
from lockstep.stream_metadata import STREAM_TAKEN_METADATA

log = logging.getLogger("lockstep.group")

POLL_S = 0.25
RECONNECT_S = 1.0
STREAM_ACK_S = 5.0  # how long a rank that answered Info may take to acknowledge a new Step stream
IDLE_CHECK_S = 5.0  # how often an idle group's ranks are health-checked


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


class GroupRanks:
    """The rank links of one group and the inbox their reports (or the reasons their streams ended) land in."""

    def __init__(self, name: str, addresses: list[str], metrics: Metrics, stall_threshold: float,
                 dead_rank_timeout: float, rank_auth: RankClientAuth | None = None,
                 coordinator_id: str = COORDINATOR_ID) -> None:
        self.name = name
        self.links = [RankLink(r, a, rank_auth, coordinator_id) for r, a in enumerate(addresses)]
        self.has_token = bool(rank_auth and rank_auth.token)
        self.metrics = metrics
        self.stall_threshold = stall_threshold
        self.dead_rank_timeout = dead_rank_timeout
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.early: list[Report] = []  # reports of a later step that came during a wait (a plan sent ahead)
        self.token_refused = False  # a rank refused this coordinator's group token at the last Info

    def __len__(self) -> int:
        return len(self.links)

    async def connect(self, waiting: Callable[[str], None],
                      unusable: Callable[[list[RankInfo]], str] = lambda infos: "") -> list[RankInfo]:
        """Wait until every rank answers as one group (all fresh, or all at the same step), catching up
        ranks a dead coordinator left one step behind; `waiting(why)` hears each new reason to wait.
        Ranks this coordinator cannot serve (`unusable(infos)` says why) get no Step stream from it: a stream
        would take them from a coordinator that can."""
        said = ""
        while True:
            infos, why = await self._infos()
            refused = ""
            if not why and len(infos) == len(self.links):  # steps apart or not: never take ranks it cannot serve
                why = refused = unusable(infos)
            if not why:  # supersede older streams first, so no plan still queued on them runs after this read
                why = await self._open_streams()
            if not why:
                infos, why = await self._infos()
            step, behind = one_step_behind(infos) if not why else (-1, [])
            if behind:
                await self._catch_up(step, behind)
                continue
            why = why or inconsistent(infos, len(self.links))
            if not why:
                break
            for link in self.links:  # a coordinator that waits holds no rank: another may be the one that can serve
                link.stop()
            if why != said:
                lasting = refused or self.token_refused  # no wait fixes these: an operator must
                log.log(logging.ERROR if lasting else logging.INFO, "group %s: waiting for its ranks: %s",
                        self.name, why)
                waiting(why)
                said = why
            await asyncio.sleep(RECONNECT_S * random.uniform(1.0, 2.0))  # two coordinators do not retry in step
        return infos

    async def _open_streams(self) -> str:
        """Open a new Step stream to every rank and wait until each rank has taken it over (its initial
        metadata): only then has the rank ended the older streams, so no plan queued on them starts after
        the Info read that follows. Returns why the group cannot go on, or ""."""
        self.inbox = asyncio.Queue()
        self.early = []
        for link in self.links:
            await link.open(self.inbox)
        acks = [asyncio.ensure_future(link.call.initial_metadata()) for link in self.links]
        _, late = await asyncio.wait(acks, timeout=STREAM_ACK_S)
        for link, ack in zip(self.links, acks, strict=True):
            if ack in late:  # a rank older than this coordinator says nothing before its first report
                ack.cancel()
                log.warning("group %s: rank %d at %s did not acknowledge its new Step stream in %g s (a rank "
                            "older than this coordinator?); reading its step anyway", self.name, link.rank,
                            link.address, STREAM_ACK_S)
                continue
            if isinstance(ack.exception(), grpc.aio.AioRpcError):
                code, details = ack.exception().code(), ack.exception().details()
            elif STREAM_TAKEN_METADATA not in tuple(ack.result() or ()):  # ended before it was taken
                code, details = await link.call.code(), await link.call.details()
            else:
                continue
            for other in self.links:  # all or none: a rank held while another refuses helps no coordinator
                other.stop()
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                return details
            return f"rank {link.rank} at {link.address} refused a new Step stream ({code.name}: {details})"
        return ""

    async def _infos(self) -> tuple[list[RankInfo], str]:
        """Every rank's Info, or why not: each rank that did not give it, with what gRPC said (a rank still
        loading, a TLS handshake refused and a dead process read differently, and an operator needs which)."""
        infos, why = [], []
        self.token_refused = False
        for link in self.links:
            try:
                infos.append(await link.info())
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    self.token_refused = True
                    why.append(f"rank {link.rank} at {link.address} refuses this coordinator's group token"
                               if self.has_token else f"rank {link.rank} at {link.address} needs a group token and "
                               "this coordinator has none (LOCKSTEP_GROUP_TOKEN or --group-token-file)")
                else:
                    details = " ".join((exc.details() or "").split())[:200]
                    why.append(f"rank {link.rank} at {link.address} does not answer ({exc.code().name}: {details})")
        return infos, "; ".join(why)

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

    def send(self, plan: Plan, flushed: set[int]) -> None:
        """Serialize the plan once (twice with a flush) and queue it for every rank's stream writer."""
        msg = wire.plan_to_proto(plan)
        flush_msg = wire.plan_to_proto(dataclasses.replace(plan, flush_prefix_cache=True)) if flushed else msg
        for link in self.links:
            link.send(flush_msg if link.rank in flushed else msg)

    async def idle(self, wakeup: asyncio.Event) -> None:
        """Wait for `wakeup`, but watch the ranks meanwhile: a stream that breaks, or a process that answers no health
        check for the dead-rank timeout (stopped or hung while idle), takes the group down now, not when the next
        request finds it silent. A health check in flight when `wakeup` comes is dropped, not waited for."""
        woken = asyncio.ensure_future(wakeup.wait())
        got: asyncio.Future | None = None
        check: asyncio.Future | None = None
        quiet: dict[int, float] = {}  # rank -> when the first health check it did not answer began
        due = time.monotonic() + IDLE_CHECK_S
        began = due
        try:
            while not woken.done():
                if got is None:
                    got = asyncio.ensure_future(self.inbox.get())
                if check is None and time.monotonic() >= due:
                    began = time.monotonic()
                    check = asyncio.ensure_future(self._not_answering(range(len(self.links))))
                waits = {woken, got} if check is None else {woken, got, check}
                await asyncio.wait(waits, timeout=None if check is not None else max(0.0, due - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if got.done():
                    rank, item = got.result()
                    got = None
                    if isinstance(item, str):
                        raise GroupDown(f"rank {rank} of group {self.name} is down: {item}", [rank])
                if check is not None and check.done():
                    self._still_quiet(check.result(), quiet, began)
                    # a silent rank is checked again once its dead-rank timeout is up, not up to a period later
                    due = min([time.monotonic() + IDLE_CHECK_S] + [t + self.dead_rank_timeout for t in quiet.values()])
                    check = None
        finally:  # also when the group's task is cancelled here: no get() or check left pending
            for pending in (woken, got, check):
                if pending is not None and not pending.done():
                    pending.cancel()

    async def _not_answering(self, ranks: Iterable[int]) -> list[int]:
        """Of these ranks, those whose process answers no health check (checked together: each may take its
        timeout). A rank blocked in a collective still answers; a stopped or hung one does not."""
        ranks = list(ranks)
        answers = await asyncio.gather(*(self.links[r].responsive() for r in ranks))
        return [r for r, alive in zip(ranks, answers, strict=True) if not alive]

    def _still_quiet(self, silent: list[int], quiet: dict[int, float], began: float) -> None:
        """Keep when each silent rank fell silent (the start of the first check it did not answer, `began`);
        raise GroupDown for those silent past the dead-rank timeout."""
        now = time.monotonic()
        for rank in [r for r in quiet if r not in silent]:
            log.info("group %s: rank %d answers its health checks again", self.name, rank)
            del quiet[rank]
        for rank in silent:
            if rank not in quiet:
                log.warning("group %s: rank %d answers no health check while the group is idle", self.name, rank)
                quiet[rank] = began
        dead = [r for r, since in quiet.items() if now - since >= self.dead_rank_timeout]
        if dead:
            raise GroupDown(f"rank(s) {dead} of group {self.name} answered no health check for "
                            f"{self.dead_rank_timeout:.0f} s while the group was idle", dead)

    async def gather(self, step: int) -> list[Report]:
        """Every rank's report of `step`, in rank order: the agreement wait."""
        wait = AgreementWait(step, list(range(len(self.links))), time.monotonic())
        early, self.early = self.early, []
        for report in early:
            if report.step == step:
                wait.record(report)
            elif report.step > step:
                self.early.append(report)
        stalled = False
        t0 = time.perf_counter()
        try:
            while not wait.done:
                try:
                    rank, item = await asyncio.wait_for(self.inbox.get(), POLL_S)
                except TimeoutError:
                    stalled, dead = await self._check_wait(wait, stalled)
                    if dead:  # after `stalled` is set: the gauge a stall raised is lowered below
                        raise GroupDown(f"rank(s) {dead} of group {self.name} silent for "
                                        f"{self.dead_rank_timeout:.0f} s at step {wait.step}", dead) from None
                    continue
                if isinstance(item, str):
                    raise GroupDown(f"rank {rank} of group {self.name} is down: {item}", [rank])
                if item.step > step:  # a rank already answered the plan sent ahead: it is the next wait's
                    self.early.append(item)
                wait.record(item)  # a duplicate or a stale step's report is ignored, never waited for again
        finally:  # a wait that took the group down is observed too: the longest waits are those
            self.metrics.agreement_wait.labels(self.name, "step").observe(time.perf_counter() - t0)
            if stalled:
                self.metrics.agreements_stalled.labels(self.name).dec()
                log.warning("group %s step %d: %s after %.1f s", self.name, step,
                            "every rank answered" if wait.done else "the wait ended with the group down",
                            time.monotonic() - wait.started_at)
        return wait.reports()

    async def _check_wait(self, wait: AgreementWait, stalled: bool) -> tuple[bool, list[int]]:
        """A wait that has gone on too long: counted and logged once past the stall threshold; past the
        dead-rank timeout, the ranks to blame for taking the group down. Returns (whether the wait is
        counted as stalled, those ranks: none while the group may wait on)."""
        now = time.monotonic()
        if not stalled and wait.stalled(now, self.stall_threshold):
            missing = wait.missing()
            silent = await self._not_answering(missing)
            log.warning("group %s step %d: agreement wait stalled for %.1f s; ranks not answered: %s; "
                        "not responding at all: %s", self.name, wait.step, now - wait.started_at, missing, silent)
            self.metrics.agreements_stalled.labels(self.name).inc()
            self.metrics.agreement_stalls.labels(self.name).inc()
            stalled = True
        dead = wait.dead(now, self.dead_rank_timeout)
        if dead:  # a rank stopped mid-step holds its live peers in the collective: blame the processes that are gone
            dead = await self._not_answering(dead) or dead
        return stalled, dead

    def poke_survivors(self, dead: list[int], step: int) -> None:
        """Send the ranks still up one empty plan. Its agreement collective cannot complete without the
        dead peer, so each survivor finds its group broken and exits, and the group can be recreated
        as a whole, instead of idling on at a step no new peer will ever reach."""
        for link in self.links:
            if link.rank not in dead and link.streaming:
                link.send(Plan(step=step))

    async def close(self) -> None:
        for link in self.links:
            await link.close()
