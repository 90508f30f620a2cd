"""The scheduler's waiting side: which waiting requests are probed, and which are admitted with what prefix.

Part of `Scheduler` (scheduler.py), kept in its own file so each stays readable: a waiting request is probed
in one plan and admitted in a later one with the prefix every rank agreed on, if it fits on every rank; one
whose prompt pages a running request is computing now is passed over, in place (prefix_sharing). A plan built
ahead (`report_step` None) uses no probe answers: a request with a prefix to agree on waits for a plan built from
the reports that answer its probe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from itertools import islice

from lockstep.chunk_columns import ChunkColumns
from lockstep.coordinator.admission import AdmissionControl, Decision
from lockstep.coordinator.agreement import ProbeBook, agreed_prefix_pages
from lockstep.coordinator.events import Event
from lockstep.coordinator.prefix_sharing import PREFIX_PENDING, computing_sibling
from lockstep.coordinator.request import FinishReason, Request, RequestStatus
from lockstep.steps import Admit, Plan, Probe, ProbeAnswer


class Admitting:
    """The Scheduler's methods for its waiting requests (see scheduler.py for the state they share)."""

    page_size: int
    salt: bytes
    ranks: int
    max_num_seqs: int
    prefix_caching: bool
    window: int
    waiting: deque[Request]
    running: list[Request]
    requests: dict[str, Request]
    _book: ProbeBook
    _events: list[Event]

    def _probe_pages(self, req: Request) -> int:
        """Pages worth probing: full pages of its tokens, short of the last token that must be computed; none
        while its prompt is being scored (prompt logprobs), as a cached position is never computed."""
        return (req.num_tokens - 1) // self.page_size if self.prefix_caching and not req.scoring_prompt else 0

    def _admit_waiting(
        self,
        control: AdmissionControl,
        batch: ChunkColumns,
        admits: list[Admit],
        report_step: int | None,
        flush: bool,
    ) -> None:
        for req in list(self.waiting):  # a request held for a prefix being computed is passed over, in place
            too_large = control.too_large(req.max_positions)
            if too_large:
                event = self._finish(req, FinishReason.ERROR, f"request {req.request_id} {too_large}")
                self._events.append(replace(event, retriable=False))
                continue
            if min(control.seqs_left, control.tokens_left) > 0 and self._held(req):  # full: none passes it
                self.stats.deferred[PREFIX_PENDING] += 1
                continue
            answers: list[ProbeAnswer | None] = []
            agreed = 0
            ready = True
            if self._probe_pages(req) > 0 and not flush:
                ready = report_step is not None and self._book.waiting_on(req.request_id) == report_step \
                    and self._book.complete(req.request_id, self.ranks)
                if ready:
                    answers = self._book.answers(req.request_id, self.ranks)
                    agreed = agreed_prefix_pages(answers, req.num_tokens, self.page_size, self.window)
            decision = control.consider(req.num_tokens, agreed, answers, ready)
            if not decision.admit:
                self.stats.deferred[decision.reason] += 1
                return
            self._admit(req, agreed, answers, decision, batch, admits)

    def _admit(
        self,
        req: Request,
        agreed: int,
        answers: list[ProbeAnswer | None],
        decision: Decision,
        batch: ChunkColumns,
        admits: list[Admit],
    ) -> None:
        self.waiting.remove(req)
        self._book.consume(req.request_id, self.ranks)
        if answers:
            for r, a in enumerate(answers):
                self.stats.prefix_offered_pages[r] += a.matched_pages if a is not None else 0
        keys = req.page_keys(agreed, self.page_size, self.salt)
        prefix = agreed * self.page_size
        if req.num_preemptions == 0:
            req.cached_tokens = prefix
        self.stats.prefix_agreed_pages += agreed
        self.stats.prefix_hit_tokens += prefix
        self.stats.prefix_queried_tokens += req.num_tokens
        req.status = RequestStatus.RUNNING
        req.num_computed = prefix
        self.running.append(req)
        admits.append(Admit(req.request_id, keys))
        batch.append(req.chunk(decision.num_tokens))

    def _held(self, req: Request, computed: dict[str, int] | None = None) -> bool:
        """Whether a running request has still to compute pages of req's prompt, so req waits for their commit."""
        pages = self._probe_pages(req)
        return computing_sibling(req, self.running, pages, self.page_size, self.salt, computed) is not None

    def _probes(self, step: int, batch: ChunkColumns, in_flight: int | None = None) -> list[Probe]:
        """Probe the requests that may be admitted next: the head of the queue, up to the free seats, passing
        over those still held once this step has run (their answers would be stale by their admission) and,
        for a plan built ahead, those the plan `in_flight` probes (asking again would drop its answers)."""
        if not self.waiting:
            return []
        after = batch.ends()
        window = max(1, self.max_num_seqs - len(self.running))
        probes = []
        asked = self._book.waiting_on
        candidates = (r for r in self.waiting if in_flight is None or asked(r.request_id) != in_flight)
        for req in islice((r for r in candidates if not self._held(r, after)), window):
            pages = self._probe_pages(req)
            if pages > 0:
                self._book.ask(req.request_id, step)
                probes.append(Probe(req.request_id, req.page_keys(pages, self.page_size, self.salt)))
        return probes

    def _answers_coming(self, plan: Plan) -> bool:
        """Whether the reports of `plan` answer a probe of a request still waiting (from its probes: the queue
        may be long, and this is asked every step)."""
        waiting = RequestStatus.WAITING
        return any((req := self.requests.get(p.request_id)) is not None and req.status is waiting
                   for p in plan.probes)

    def _unadmit(self, admits: Sequence[Admit], behind: int = 0) -> None:
        """Admissions of a plan no rank ran (each undid what it pinned): their requests wait again, in front, or
        behind the first `behind` waiting (requests that ran before they were admitted, preempted since)."""
        at = min(behind, len(self.waiting))
        for admit in reversed(admits):
            req = self.requests.get(admit.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                req.status, req.num_computed = RequestStatus.WAITING, 0
                if req.num_preemptions == 0:
                    req.cached_tokens = 0
                self.waiting.insert(at, req)
