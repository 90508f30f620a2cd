"""The coordinator: its groups, request routing, and the bridge from scheduler events to clients.

Each group keeps its own step loop and its own decisions; no agreement spans two groups. A request
goes to the least-loaded group whose ranks are all up; a group that is down takes no new requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from lockstep.coordinator.group import GroupDown, GroupRunner
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.openai_api import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import Scheduler
from lockstep.kv.page_keys import key_salt
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.coordinator")


@dataclass
class SchedulerLimits:
    page_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    prefix_caching: bool = True


@dataclass
class _Live:
    """A request between the API and its group: the scheduler's record and the client's queue."""

    request: Request
    group: str
    queue: asyncio.Queue
    arrived: float
    prompt_tokens: int
    last_token_at: float | None = None


class Coordinator:
    def __init__(
        self,
        groups: dict[str, list[str]],
        tokenizer: Tokenizer,
        model_name: str,
        limits: SchedulerLimits,
        max_model_len: int,
        stall_threshold: float = 5.0,
        dead_rank_timeout: float = 30.0,
        replay_timeout: float = 0.0,
    ) -> None:
        self.replay_timeout = replay_timeout
        self._parked: dict[str, tuple[Request, str]] = {}
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.max_model_len = max_model_len
        self.metrics = Metrics()
        self.group_addresses = groups
        self.stall_threshold = stall_threshold
        self.dead_rank_timeout = dead_rank_timeout
        self.groups: dict[str, GroupRunner] = {}
        self.live: dict[str, _Live] = {}
        self._seen: dict[str, dict] = {}

    def start(self) -> None:
        """Start every group's loop; each connects on its own, so one group that is down never holds
        up the others (and comes back by itself once its ranks are whole again)."""
        for name, addresses in self.group_addresses.items():
            runner = GroupRunner(name, addresses, self.metrics, lambda events, g=name: self._dispatch(g, events),
                                 self._replay, self.stall_threshold, self.dead_rank_timeout,
                                 on_up=self._group_up)
            runner.start(lambda infos, g=name: self._make_scheduler(g, infos))
            self.groups[name] = runner

    async def wait_ready(self) -> None:
        """Return once at least one group is up."""
        waits = [asyncio.ensure_future(g.ready.wait()) for g in self.groups.values()]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _make_scheduler(self, group: str, infos: list) -> Scheduler:
        for r, info in enumerate(infos):
            if info.page_size != self.limits.page_size:
                raise ValueError(f"rank {r} uses page size {info.page_size}, the coordinator {self.limits.page_size}")
            if info.model_id != infos[0].model_id:
                raise ValueError(f"rank {r} serves {info.model_id}, rank 0 {infos[0].model_id}")
        self._seen.pop(group, None)
        totals = [n for i in infos for n in i.pool_totals.values()]
        self.groups[group].capacity_tokens = min(totals) * self.limits.page_size if totals else 0
        return Scheduler(
            page_size=self.limits.page_size,
            salt=key_salt(infos[0].model_id, self.limits.page_size),
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            max_num_seqs=self.limits.max_num_seqs,
            ranks=len(infos),
            prefix_caching=self.limits.prefix_caching,
            max_model_len=min([self.max_model_len, *(i.max_model_len for i in infos)]),
        )

    def healthy(self) -> bool:
        return any(g.up for g in self.groups.values())

    def health_detail(self) -> dict:
        return {name: {"up": g.up, "reason": g.down_reason, "step": g.step} for name, g in self.groups.items()}

    def metrics_text(self) -> bytes:
        for name, g in self.groups.items():
            if g.scheduler is not None:
                self.metrics.requests.labels(name, "waiting").set(g.scheduler.num_waiting)
                self.metrics.requests.labels(name, "running").set(g.scheduler.num_running)
        return self.metrics.render()

    async def reset_prefix_cache(self, rank: int | None) -> None:
        try:
            await asyncio.gather(*(g.flush(rank) for g in self.groups.values() if g.up))
        except GroupDown as exc:
            raise ApiError(503, f"the flush did not complete: {exc}", code="group_unavailable",
                           err_type="service_unavailable") from exc

    def _replay(self, group: str, requests: list[Request], reason: str) -> None:
        """A group went down: its requests go on in the least-loaded group that is up, recomputed from
        what they had. With no group up they wait up to `replay_timeout` for one to come back (the
        operator recreates a broken group), and past it, or with no wait allowed, end with the
        retriable error."""
        for req in requests:
            if req.request_id not in self.live:
                continue
            if self._move(req, exclude=group):
                continue
            if self.replay_timeout > 0:
                self._parked[req.request_id] = (req, reason)
                asyncio.get_running_loop().call_later(self.replay_timeout, self._expire, req.request_id)
            else:
                self._fail(req, reason)

    def _move(self, req: Request, exclude: str = "") -> bool:
        """Hand the request to the least-loaded group that is up; False when there is none."""
        live = self.live[req.request_id]
        up = [g for g in self.groups.values() if g.up and g.name != exclude and g.scheduler is not None]
        if not up:
            return False
        target = min(up, key=lambda g: g.scheduler.num_waiting + g.scheduler.num_running)
        try:
            target.scheduler.adopt(req)
        except ValueError as exc:
            self._fail(req, str(exc))
            return True
        log.warning("request %s moves from group %s to %s after %d token(s)", req.request_id, live.group,
                    target.name, len(req.generated))
        live.group = target.name
        target.kick()
        return True

    def _fail(self, req: Request, reason: str) -> None:
        live = self.live.get(req.request_id)
        if live is not None:
            live.queue.put_nowait(TokenEvent(None, None, req.cached_tokens, error=reason))

    def _group_up(self, group: str) -> None:
        """A group (re)formed: the requests waiting for one go on there."""
        for rid, (req, _) in list(self._parked.items()):
            if rid not in self.live:
                del self._parked[rid]
            elif self._move(req):
                del self._parked[rid]

    def _expire(self, request_id: str) -> None:
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            req, reason = parked
            self._fail(req, f"{reason}; no group came back within {self.replay_timeout:.0f} s")

    def _pick_group(self) -> GroupRunner:
        up = [g for g in self.groups.values() if g.up and g.scheduler is not None]
        if not up:
            reasons = "; ".join(g.down_reason for g in self.groups.values()) or "no group is up"
            raise ApiError(503, f"no group can serve now ({reasons}); retry later", code="group_unavailable",
                           err_type="service_unavailable")
        return min(up, key=lambda g: g.scheduler.num_waiting + g.scheduler.num_running)

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncIterator[TokenEvent]:
        """Queue the request now (so a refusal is an HTTP status, not an error inside a stream) and
        return its events; closing the iterator early aborts it and frees its pages."""
        if request_id in self.live:
            raise ApiError(409, f"request id {request_id!r} is already running", "request_id",
                           "request_id_in_use")
        group = self._pick_group()
        max_tokens = spec.max_tokens
        if not spec.max_tokens_given and group.capacity_tokens:  # "up to the context" means what fits
            max_tokens = max(1, min(max_tokens, group.capacity_tokens - len(spec.prompt_ids)))
        try:
            request = Request(request_id, spec.prompt_ids, spec.sampling, max_tokens, spec.stop_token_ids)
            group.scheduler.add(request)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        self.live[request_id] = _Live(request, group.name, asyncio.Queue(), time.monotonic(), len(spec.prompt_ids))
        group.kick()
        return self._events(request_id)

    async def _events(self, request_id: str) -> AsyncIterator[TokenEvent]:
        live = self.live[request_id]
        finished = False
        try:
            while True:
                ev: TokenEvent = await live.queue.get()
                yield ev
                if ev.finish_reason is not None or ev.error:
                    finished = True
                    return
        finally:
            self.live.pop(request_id, None)
            runner = self.groups.get(live.group)
            if not finished and runner is not None and runner.scheduler is not None:
                runner.scheduler.abort(request_id)
                runner.kick()

    def _dispatch(self, group: str, events: list) -> None:
        now = time.monotonic()
        runner = self.groups.get(group)
        if runner is not None:
            self._export_stats(group, runner)
        for ev in events:
            live = self.live.get(ev.request_id)
            if live is None:
                continue
            if ev.kind == "token":
                cached = live.request.cached_tokens
                if live.last_token_at is None:
                    self.metrics.ttft.labels(group).observe(now - live.arrived)
                else:
                    self.metrics.itl.labels(group).observe(now - live.last_token_at)
                live.last_token_at = now
                self.metrics.generation_tokens.labels(group).inc()
                live.queue.put_nowait(TokenEvent(ev.token_id, None, cached))
            elif ev.kind == "finished":
                cached = live.request.cached_tokens
                if ev.finish_reason == "error":
                    status = 503 if ev.retriable else 400
                    live.queue.put_nowait(TokenEvent(None, None, cached, error=ev.error, status=status))
                else:
                    live.queue.put_nowait(TokenEvent(None, ev.finish_reason, cached))
                self.metrics.request_duration.labels(group).observe(now - live.arrived)
                self.metrics.prompt_tokens.labels(group).inc(live.prompt_tokens)

    def _export_stats(self, group: str, runner: GroupRunner) -> None:
        """The scheduler keeps running totals; Prometheus counters take the increments."""
        stats = runner.scheduler.stats
        seen = self._seen.setdefault(group, {"preemptions": 0, "agreed": 0, "hits": 0, "offered": {},
                                             "deferred": {}})
        m = self.metrics
        m.preemptions.labels(group).inc(stats.preemptions - seen["preemptions"])
        m.prefix_agreed.labels(group).inc(stats.prefix_agreed_pages - seen["agreed"])
        m.prefix_hit_tokens.labels(group).inc(stats.prefix_hit_tokens - seen["hits"])
        for rank, offered in enumerate(stats.prefix_offered_pages):
            m.prefix_offered.labels(group, str(rank)).inc(offered - seen["offered"].get(rank, 0))
            seen["offered"][rank] = offered
        for reason, n in stats.deferred.items():
            m.admission_deferred.labels(group, reason).inc(n - seen["deferred"].get(reason, 0))
            seen["deferred"][reason] = n
        seen.update(preemptions=stats.preemptions, agreed=stats.prefix_agreed_pages, hits=stats.prefix_hit_tokens)

    async def close(self) -> None:
        for g in self.groups.values():
            await g.close()
