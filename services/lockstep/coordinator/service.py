"""The coordinator: its groups, request routing, and the bridge from scheduler events to clients.

Each group keeps its own step loop and its own decisions; no agreement spans two groups. A request
goes to the least-loaded group whose ranks are all up; a group that is down takes no new requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.events import Event, EventKind
from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.group import GroupDown, GroupRunner
from lockstep.coordinator.metrics import Metrics
from lockstep.coordinator.request import FinishReason, Request
from lockstep.coordinator.scheduler import Scheduler
from lockstep.kv.page_keys import key_salt
from lockstep.steps import RankInfo
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.coordinator")


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
    """Every group of one deployment behind one API: routing, replay, and each request's event queue."""

    def __init__(self, config: CoordinatorConfig, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = Metrics()
        self.groups: dict[str, GroupRunner] = {}
        self.live: dict[str, _Live] = {}
        self._parked: dict[str, tuple[Request, str]] = {}

    def start(self) -> None:
        """Start every group's loop; each connects on its own, so one group that is down never holds
        up the others (and comes back by itself once its ranks are whole again)."""
        for name, addresses in self.config.groups.items():
            runner = GroupRunner(name, list(addresses), self.metrics, self._dispatch, self._replay, self._group_up,
                                 self.config.stall_threshold, self.config.dead_rank_timeout)
            runner.start(self._make_scheduler)
            self.groups[name] = runner

    async def wait_ready(self) -> None:
        """Return once at least one group is up."""
        waits = [asyncio.ensure_future(g.ready.wait()) for g in self.groups.values()]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _make_scheduler(self, infos: list[RankInfo]) -> Scheduler:
        """A fresh scheduler for a group that (re)formed; ValueError when its ranks cannot be one group."""
        cfg = self.config
        for r, info in enumerate(infos):
            if info.page_size != cfg.page_size:
                raise ValueError(f"rank {r} uses page size {info.page_size}, the coordinator {cfg.page_size}")
            if info.model_id != infos[0].model_id:
                raise ValueError(f"rank {r} serves {info.model_id}, rank 0 {infos[0].model_id}")
        return Scheduler(
            page_size=cfg.page_size,
            salt=key_salt(infos[0].model_id, cfg.page_size),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            ranks=len(infos),
            prefix_caching=cfg.prefix_caching,
            max_model_len=min([self.max_model_len, *(i.max_model_len for i in infos)]),
        )

    def healthy(self) -> bool:
        return any(g.up for g in self.groups.values())

    def health_detail(self) -> dict:
        return {name: {"up": g.up, "reason": g.down_reason, "step": g.step} for name, g in self.groups.items()}

    def metrics_text(self) -> bytes:
        for name, g in self.groups.items():
            waiting, running = g.counts()
            self.metrics.requests.labels(name, "waiting").set(waiting)
            self.metrics.requests.labels(name, "running").set(running)
        return self.metrics.render()

    async def reset_prefix_cache(self, rank: int | None) -> None:
        try:
            await asyncio.gather(*(g.flush(rank) for g in self.groups.values() if g.up))
        except GroupDown as exc:
            raise ApiError(503, f"the flush did not complete: {exc}", code="group_unavailable",
                           err_type="service_unavailable") from exc

    def step_log(self, group: str | None, since: int) -> dict:
        """A group's step timings from entry `since` of its log (None: the first group), for GET /admin/steps:
        where a step's time goes (plan, send, agreement wait, apply, the slowest rank's engine). The log
        restarts when the group re-forms, so `next` may fall below a caller's `since`. KeyError: no such group."""
        name = group if group is not None else next(iter(self.groups), None)
        runner = self.groups.get(name) if name is not None else None
        if runner is None:
            raise KeyError(group)
        steps, next_index = runner.step_log(since)
        return {"group": name, "steps": [list(t) for t in steps], "next": next_index}

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
            if self.config.replay_timeout > 0:
                self._parked[req.request_id] = (req, reason)
                asyncio.get_running_loop().call_later(self.config.replay_timeout, self._expire, req.request_id)
            else:
                self._fail(req, reason)

    def _move(self, req: Request, exclude: str = "") -> bool:
        """Hand the request to the least-loaded group that is up; False when there is none."""
        live = self.live[req.request_id]
        up = [g for g in self.groups.values() if g.serving and g.name != exclude]
        if not up:
            return False
        target = min(up, key=lambda g: g.load)
        try:
            target.adopt(req)
        except ValueError as exc:
            self._fail(req, str(exc))
            return True
        log.warning("request %s moves from group %s to %s after %d token(s)", req.request_id, live.group,
                    target.name, len(req.generated))
        self.metrics.requests_migrated.labels(live.group).inc()
        self.metrics.routing_decisions.labels(target.name, "replay").inc()
        live.group = target.name
        return True

    def _fail(self, req: Request, reason: str) -> None:
        live = self.live.get(req.request_id)
        if live is not None:
            self.metrics.requests_dropped.labels(live.group).inc()
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
            self._fail(req, f"{reason}; no group came back within {self.config.replay_timeout:.0f} s")

    def _pick_group(self) -> GroupRunner:
        up = [g for g in self.groups.values() if g.serving]
        if not up:
            reasons = "; ".join(g.down_reason for g in self.groups.values()) or "no group is up"
            raise ApiError(503, f"no group can serve now ({reasons}); retry later", code="group_unavailable",
                           err_type="service_unavailable")
        return min(up, key=lambda g: g.load)

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
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
            group.submit(request)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        self.live[request_id] = _Live(request, group.name, asyncio.Queue(), time.monotonic(), len(spec.prompt_ids))
        self.metrics.routing_decisions.labels(group.name, "least_loaded").inc()
        return self._events(request_id)

    async def _events(self, request_id: str) -> AsyncGenerator[TokenEvent, None]:
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
            if not finished and runner is not None:
                runner.abort(request_id)

    def _dispatch(self, group: str, events: list[Event]) -> None:
        now = time.monotonic()
        for ev in events:
            live = self.live.get(ev.request_id)
            if live is None:
                continue
            if ev.kind == EventKind.TOKEN:
                cached = live.request.cached_tokens
                if live.last_token_at is None:
                    self.metrics.ttft.labels(group).observe(now - live.arrived)
                else:
                    self.metrics.itl.labels(group).observe(now - live.last_token_at)
                live.last_token_at = now
                self.metrics.generation_tokens.labels(group).inc()
                live.queue.put_nowait(TokenEvent(ev.token_id, None, cached))
            elif ev.kind == EventKind.FINISHED:
                cached = live.request.cached_tokens
                if ev.finish_reason == FinishReason.ERROR:
                    status = 503 if ev.retriable else 400
                    live.queue.put_nowait(TokenEvent(None, None, cached, error=ev.error, status=status))
                else:
                    live.queue.put_nowait(TokenEvent(None, ev.finish_reason, cached))
                self.metrics.request_duration.labels(group).observe(now - live.arrived)
                self.metrics.prompt_tokens.labels(group).inc(live.prompt_tokens)

    async def close(self) -> None:
        for g in self.groups.values():
            await g.close()
