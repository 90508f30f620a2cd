"""The scheduler: plan k+1 of a group from the reports of step k of every rank.

Continuous batching with chunked prefill under a token budget: running requests first, oldest first,
then waiting requests in arrival order while they fit on every rank.
With prefix caching a waiting request is probed in one plan and may be admitted in the next with the
prefix every rank agreed on; one whose prompt pages a running request is computing now is passed over, in
place, until they are committed (prefix_sharing). A running request that cannot grow on some rank makes the
newest running requests give way: they are released everywhere and requeued in front, to be recomputed
with their generated tokens kept.

Calling protocol (one group, one thread):

    plan = scheduler.plan(k, last_reports)  # reports of the last plan, one per rank ([] before any)
    ... every rank carries out `plan` and reports ...
    events = scheduler.apply(reports)       # tokens, finishes, preemptions of step k

Every plan must be carried out and applied before the next one is built from reports, except one built
ahead: `plan_ahead(k + 1)` while plan k is in flight carries the running requests on (lookahead.py), probes, and
admits what needs no probe answer; apply() takes the reports of the plans in flight in order.
Events decided while planning are returned by the next apply().
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from lockstep.chunk_columns import ChunkColumns
from lockstep.coordinator.admission import AdmissionControl
from lockstep.coordinator.admitting import Admitting
from lockstep.coordinator.agreement import ProbeBook
from lockstep.coordinator.events import Event, EventKind, token_event
from lockstep.coordinator.lookahead import chunks_ahead
from lockstep.coordinator.rebalance import Move, Rebalancer
from lockstep.coordinator.request import FinishReason, Request, RequestStatus
from lockstep.coordinator.step_reports import LastPools, in_rank_order, plan_reports, sampled_by_request
from lockstep.steps import Admit, Plan, Report

_PROMPT_LOGPROBS = attrgetter("sampling.prompt_logprobs")
TOKEN, FINISHED, PREEMPTED = EventKind.TOKEN, EventKind.FINISHED, EventKind.PREEMPTED  # as callers import them


@dataclass
class SchedulerStats:
    """Running totals for the service's counters (it exports the increments)."""

    preemptions: int = 0
    deferred: Counter[str] = field(default_factory=Counter)
    prefix_offered_pages: list[int] = field(default_factory=list)
    prefix_agreed_pages: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0  # the tokens of every admission (hits are a share of them)
    failed_steps: int = 0


class Scheduler(Admitting):
    """The pure decision core of one group of `ranks` ranks."""

    def __init__(
        self,
        page_size: int,
        salt: bytes,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        ranks: int,
        prefix_caching: bool = True,
        max_model_len: int | None = None,
        window: int = 0,
        rebalancer: Rebalancer | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if type(long_prefill_token_threshold) is not int or long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {long_prefill_token_threshold!r}")
        for name, value in (
            ("page_size", page_size),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("ranks", ranks),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(salt, bytes) or not salt:
            raise ValueError(f"salt must be the bytes of key_salt(), got {salt!r:.80}")
        if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2 or None, got {max_model_len!r}")
        self.page_size = page_size
        self.salt = salt
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.ranks = ranks
        self.prefix_caching = prefix_caching
        self.max_model_len = max_model_len
        self.window = window  # tokens a `sliding` pool's layers see; 0: the group has no such pool
        self.rebalancer = rebalancer
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: a chunk may take the whole budget
        self.rebalances = 0  # rebalances carried out (the service exports them)
        self._now = 0.0
        self._move: Move | None = None  # the rebalance of the plan in flight
        self.stats = SchedulerStats(prefix_offered_pages=[0] * ranks)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._book = ProbeBook()
        self._releases: list[str] = []
        self._events: list[Event] = []
        self._last_plan: Plan | None = None
        self._flight: deque[Plan] = deque()  # plans built and not applied yet, oldest first
        self._spent: dict[str, list[int]] = {}  # the pages the last plan takes, per pool and rank
        self._after_refusal = -1  # a plan built ahead of a step that was then refused: refused in turn
        self._preempted_ahead = 0  # requests that refused step preempted to the queue's front, ahead of its admits
        self._applied: int | None = None
        self._reports: list[Report] = []  # the last applied reports, pools filled in
        self._refused_in_a_row = 0
        self._pools = LastPools()

    # ----- requests in and out

    def add(self, request: Request) -> None:
        """Queue a new request (FCFS). Its id must not be live; its record is the caller's to read."""
        if not isinstance(request, Request):
            raise ValueError(f"add() takes a Request, got {type(request).__name__}")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.generated or request.num_computed:
            raise ValueError(f"request {request.request_id} was already scheduled ({request!r})")
        problem = self.cannot_hold(request)
        if problem:
            raise ValueError(problem)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def adopt(self, requests: Sequence[Request]) -> None:
        """Take over requests that another group was running when it went down: they are recomputed here
        from their prompts and the tokens they had generated (which their clients already have), ahead
        of this group's waiting requests and in the order given (oldest first). All or none are taken."""
        ids = [r.request_id for r in requests]
        for request in requests:
            if request.request_id in self.requests or ids.count(request.request_id) > 1:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            if request.status is not RequestStatus.WAITING or request.num_computed:
                raise ValueError(f"request {request.request_id} is not waiting for a recompute ({request!r})")
            problem = self.cannot_hold(request)
            if problem:
                raise ValueError(problem)
        for request in reversed(requests):
            request.forget_keys()
            self.requests[request.request_id] = request
            self.waiting.appendleft(request)

    def cannot_hold(self, request: Request) -> str:
        """Why this group can never serve the request (its positions), or "" when it can."""
        if self.max_model_len is not None and request.max_positions + 1 > self.max_model_len:
            return (f"request {request.request_id}: {len(request.prompt_token_ids)} prompt tokens + max_tokens"
                    f" {request.max_tokens} exceed the model's {self.max_model_len} positions")
        return ""

    def abort(self, request_id: str) -> list[Event]:
        """End a request now; if the ranks hold it, the next plan releases it. Unknown id: no events."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        return [self._finish(req, FinishReason.ABORT)]

    def requeue_all(self) -> list[Event]:
        """The group went down but keeps its requests: every running one goes back to the front of the
        queue, to be recomputed (generated tokens kept) once the group is whole again.

        It forgets the in-flight plan; the next plan may start from no reports.
        """
        events = [self._preempt(req, self._releases, counted=False) for req in reversed(self.running)]
        self._events.clear()
        self._last_plan = None
        self._flight.clear()
        self._applied = None
        self._book = ProbeBook()
        return events

    def hand_over(self) -> list[Request]:
        """Give every request up to another group, between two plans: the running ones are released on
        these ranks by the next plan, and all of them (oldest first) are the caller's to adopt elsewhere,
        where they are recomputed with their generated tokens kept."""
        for req in reversed(self.running):
            self._preempt(req, self._releases, counted=False)
        out = list(self.waiting)
        self.waiting.clear()
        for req in out:
            del self.requests[req.request_id]
            self._book.forget(req.request_id)
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._releases)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ----- planning

    def plan(self, step: int, reports: Sequence[Report], flush: bool = False, now: float = 0.0) -> Plan:
        """Plan `step` from the reports of the last plan (all ranks; [] before the first report).

        `flush`: some rank drops its prefix cache at this step (after releases, before pins), so nothing
        is admitted with a cached prefix in it; the probes it answers after the flush are fresh. `now` is
        the coordinator's clock, for the rebalance cooldown; a rebalance step carries nothing but releases.
        """
        reports = self._pools.fill(self._check_plan_reports(step, reports))
        releases, self._releases = self._releases, []
        self._now = now
        move = None
        if reports and not flush and self.rebalancer is not None:
            move = self.rebalancer.decide(step, now, reports)
        if move is not None:
            self._move = move
            return self._sent(Plan(step, releases=tuple(dict.fromkeys(releases)),
                                   pool_split=tuple(sorted((move.split or {}).items())),
                                   pool_fence=tuple(sorted((move.fence or {}).items()))), {})
        batch = ChunkColumns.empty()
        admits: list[Admit] = []
        spent: dict[str, list[int]] = {}
        if reports:
            control = self._control(reports)
            preempted = self._schedule_running(control, batch, releases)
            if preempted:
                self.stats.deferred["pages"] += 1
            else:
                self._admit_waiting(control, batch, admits, reports[0].step, flush)
            spent = control.spent()
        probes = self._probes(step, batch) if self.prefix_caching else []
        plan = Plan(
            step=step,
            releases=tuple(dict.fromkeys(releases)),
            admits=tuple(admits),
            batch=batch,
            probes=tuple(probes),
        )
        return self._sent(plan, spent)

    def plan_ahead(self, step: int) -> Plan | None:
        """Plan `step` while the plan before it is in flight (overlap), from the last applied reports and what
        that plan takes; None when the next plan must wait for its reports: some request cannot grow or scores
        its prompt, the group may rebalance at `step` (its rebalancer checks there), the plan in flight was not a
        plain work step, or, with a seat free, that plan's reports answer a waiting request's probe (it is
        admitted from them at once: an arrival costs the overlap one step, and its time to first token nothing).

        A plan built ahead probes the waiting requests too, but pins nothing: probe answers say what a rank held
        when it answered, and the step in flight may evict or flush it since. So it admits only requests with no
        prefix to agree on (too short to probe, or no prefix caching); the others wait for a plan built from the
        reports that answer their probe."""
        last = self._last_plan
        if (len(self._flight) != 1 or last.step + 1 != step or not last.batch or last.step == self._after_refusal
                or not self._reports or self.rebalancer is not None and self.rebalancer.checks_at(step)
                or self._scoring_prompt()):
            return None
        seats = self.waiting and len(self.running) < self.max_num_seqs
        if seats and self._answers_coming(last):
            return None
        control = self._control(self._reports)
        control.charge(self._spent)
        batch = chunks_ahead(self.running, last, control)
        if not batch:  # carrying nothing on, it would not be refused with a refused step in flight: wait
            return None
        admits: list[Admit] = []
        if seats:
            self._admit_waiting(control, batch, admits, None, False)
        probes = self._probes(step, batch, in_flight=last.step) if self.prefix_caching else []
        releases, self._releases = tuple(dict.fromkeys(self._releases)), []
        plan = Plan(step, releases=releases, admits=tuple(admits), batch=batch, probes=tuple(probes))
        return self._sent(plan, control.spent())

    def _scoring_prompt(self) -> bool:
        """Whether a running request still scores its prompt: only one that asked for prompt logprobs may, and one
        C-level pass over the requests' parameters finds none most steps."""
        asked = max(map(_PROMPT_LOGPROBS, self.running), default=-1) >= 0
        return asked and any(r.scoring_prompt for r in self.running)

    def _sent(self, plan: Plan, spent: dict[str, list[int]]) -> Plan:
        self._last_plan, self._spent = plan, spent
        self._flight.append(plan)
        return plan

    def _control(self, reports: list[Report]) -> AdmissionControl:
        return AdmissionControl(reports, self.page_size, self.max_num_seqs, self.max_num_batched_tokens,
                                len(self.running), self.window, self.long_prefill_token_threshold)

    def _check_plan_reports(self, step: int, reports: Sequence[Report]) -> list[Report]:
        if self._flight:
            raise ValueError(f"plan {self._flight[0].step} was not applied: call apply() with its reports first")
        last = self._last_plan
        return plan_reports(step, reports, None if last is None else last.step, self.ranks)

    def _schedule_running(self, control: AdmissionControl, batch: ChunkColumns, releases: list[str]) -> bool:
        """Give every running request its next chunk while it fits; where one cannot grow, preempt the
        newest running requests until the pages they hold cover its shortfall in every pool. Their pages
        are free only from the next report, so the request itself waits this step; what they free beyond its
        shortfall (`spare`) covers the next request that cannot grow before another victim is taken, as
        vLLM's freed blocks serve the next request. Returns whether anything was preempted."""
        preempted = False
        spare: dict[str, int] = {}  # pages this step's victims free beyond the shortfalls they covered
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue
            if self._grow(control, req, batch):
                continue
            if control.tokens_left <= 0:
                continue
            short = control.shortfall(req.num_computed, req.num_uncomputed)
            for name, n in short.items():
                covered = min(n, spare.get(name, 0))
                spare[name] = spare.get(name, 0) - covered
                short[name] = n - covered
            while any(n > 0 for n in short.values()):
                victim = self.running[-1]  # newer than req, so not in this step's batch yet
                freed = control.held(victim.num_computed)
                short = {name: n - freed[name] for name, n in short.items()}
                self._events.append(self._preempt(victim, releases))
                preempted = True
                if victim is req:
                    break
            for name, n in short.items():
                spare[name] = spare.get(name, 0) - min(n, 0)
        return preempted

    def _grow(self, control: AdmissionControl, req: Request, batch: ChunkColumns) -> bool:
        n = control.grow(req.num_computed, req.num_uncomputed)
        if n == 0:
            return False
        batch.append(req.chunk(n))
        return True

    def _preempt(self, req: Request, releases: list[str], counted: bool = True) -> Event:
        self.running.remove(req)
        releases.append(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._book.forget(req.request_id)
        self.stats.preemptions += counted
        return Event(req.request_id, PREEMPTED)

    # ----- reports

    def apply(self, reports: Sequence[Report]) -> list[Event]:
        """Take in the reports of the last plan (every rank): tokens, finishes, probe answers.

        A second delivery of the same step's reports changes nothing and returns no events. A step that
        some rank refused (Report.error) fails the requests it admitted; when every rank refused, nothing
        ran, so the others are planned again as they were; when only some did, the ranks no longer agree
        on what the others hold, so those are preempted (released everywhere, recomputed).
        """
        if not reports:
            raise ValueError("apply() needs the reports of every rank")
        plan = self._flight[0] if self._flight else None
        ordered = in_rank_order(reports, self.ranks)
        step = ordered[0].step
        if self._applied is not None and step <= self._applied:
            return []
        if plan is None or step != plan.step:
            expected = "no plan is in flight" if plan is None else f"the oldest plan in flight is step {plan.step}"
            raise ValueError(f"reports of step {step} do not answer a plan in flight ({expected})")
        self._flight.popleft()
        self._applied = step
        self._reports = self._pools.fill(ordered)
        events, self._events = self._events, []
        failed = [r for r in ordered if r.error]
        if (plan.pool_split or plan.pool_fence) and self.rebalancer is not None:
            self.rebalancer.applied(self._move, not failed, self._now)
            self.rebalances += bool(plan.pool_split) and not failed
        if failed:
            self._apply_failure(plan, ordered, failed, events)
        else:
            self._apply_success(plan, ordered, events)
        return events

    def _apply_failure(self, plan: Plan, reports: list[Report], failed: list[Report], events: list[Event]) -> None:
        if plan.step == self._after_refusal:  # built ahead of a refused step, so refused with it: nothing ran
            self._releases.extend(plan.releases)
            self._unadmit(plan.admits, behind=self._preempted_ahead)  # those ran before these were admitted
            return
        self._preempted_ahead = 0
        if self._flight:
            self._after_refusal = self._flight[0].step
        self.stats.failed_steps += 1
        self._refused_in_a_row += 1
        message = f"step {plan.step} refused: " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
        self._releases.extend(plan.releases)
        admitted = {a.request_id for a in plan.admits}
        for rid in admitted:
            req = self.requests.get(rid)
            if req is not None:
                events.append(self._finish(req, FinishReason.ERROR, message))
        if len(failed) == len(reports) and self._refused_in_a_row < 2:
            return  # nothing ran anywhere: plan the rest again as it was, once; twice means they disagree
        preempted = []
        for chunk in reversed(plan.batch):  # each goes to the front of the queue: they end up in the order they ran
            req = self.requests.get(chunk.request_id)
            if req is not None and req.status is RequestStatus.RUNNING and chunk.request_id not in admitted:
                preempted.append(self._preempt(req, self._releases))
        events.extend(reversed(preempted))
        self._preempted_ahead = len(preempted)

    def _apply_success(self, plan: Plan, reports: list[Report], events: list[Event]) -> None:
        self._refused_in_a_row = 0
        for report in reports:
            for answer in report.probes:
                self._book.record(report.step, report.rank, answer)
        sampled = sampled_by_request(reports)
        scores = {p.request_id: p for report in reversed(reports) for p in report.prompt_logprobs}
        requests, running, b = self.requests, RequestStatus.RUNNING, ChunkColumns.of(plan.batch)
        extras = b.extras
        for i, (rid, start, n, sample) in enumerate(zip(b.request_ids, b.starts, b.token_counts, b.sample,
                                                        strict=True)):  # once per running request every step
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue
            if req.num_computed != start:
                raise AssertionError(f"{req!r} is at {req.num_computed}, its chunk started at {start}")
            req.num_computed = start + n
            scored = i not in extras or req.take_prompt_scores(extras[i][0], scores.get(rid))
            if not sample:
                continue
            got = sampled.get(rid)
            if got is None or not scored:
                events.append(self._finish(req, FinishReason.ERROR, f"no rank sampled a token at step {plan.step}"))
                continue
            reason = req.append(got.token_id)
            events.append(token_event(rid, got.token_id, got.logprobs,
                                      req.prompt_logprobs_to_send() if req.sampling.prompt_logprobs >= 0 else None))
            if reason is not None:
                events.append(self._finish(req, reason))

    def _finish(self, req: Request, reason: FinishReason, error: str = "") -> Event:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._releases.append(req.request_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.finish(reason, error)
        if self.rebalancer is not None and reason is not FinishReason.ERROR:
            self.rebalancer.sample(len(req.prompt_token_ids) + len(req.generated))
        self.requests.pop(req.request_id, None)
        self._book.forget(req.request_id)
        return Event(req.request_id, FINISHED, finish_reason=reason, error=error)
