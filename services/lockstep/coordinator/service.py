"""The coordinator: its groups, request routing, and the bridge from scheduler events to clients.

Each group keeps its own step loop and its own decisions; no agreement spans two groups. A request
goes to a serving group that coordinator/routing.py picks (the group last sent its prefix, unless far
busier; else the least loaded); a group that is down or draining takes no new requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.events import Event, EventKind
from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.group import GroupDown, GroupRunner
from lockstep.coordinator.group_list import GroupsDiff, diff_groups
from lockstep.coordinator.metrics import REJECTION_REASONS, Metrics, forget_group_series
from lockstep.coordinator.outbox import Outbox
from lockstep.coordinator.rebalance import Rebalancer
from lockstep.coordinator.request import FinishReason, Request
from lockstep.coordinator.request_events import EventSink, RequestEvents, token_out
from lockstep.coordinator.routing import GroupLoad, PrefixRouter, Route, RoutingPolicy
from lockstep.coordinator.scheduler import Scheduler
from lockstep.kv.page_keys import key_salt, page_keys
from lockstep.kv.paging import POOL_FULL, POOL_SLIDING
from lockstep.steps import RankInfo
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.coordinator")


@dataclass
class _Live:
    """A request between the API and its group: the scheduler's record and the client's queue."""

    request: Request
    group: str
    queue: EventSink
    arrived: float
    prompt_tokens: int
    last_token_at: float | None = None
    expected_hit_tokens: int = 0  # what routing expected the group to skip; settled at the first token


class Coordinator:
    """Every group of one deployment behind one API: routing, replay, and each request's event queue."""

    def __init__(self, config: CoordinatorConfig, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_logprobs = config.max_logprobs
        self.metrics = Metrics()
        self.groups: dict[str, GroupRunner] = {}
        self.group_addresses: dict[str, tuple[str, ...]] = {}  # what each runner was started with
        self._regrouping = asyncio.Lock()  # one change of the group list at a time
        self._leaving: set[str] = set()  # groups being removed: drained for good, never resumed
        self.live: dict[str, _Live] = {}
        # requests no group can take now: (request, why, the timer that fails it past replay_timeout)
        self._parked: dict[str, tuple[Request, str, asyncio.TimerHandle]] = {}
        self.group_up_listeners: list[Callable[[str], None]] = []  # e.g. `lockstep serve`'s supervisors
        self.router = PrefixRouter(config.page_size, RoutingPolicy(config.routing))
        self._routing_salt = key_salt(model_name or "model", config.page_size, "lockstep-routing")

    def start(self) -> None:
        """Start every group's loop; each connects on its own, so one group that is down never holds
        up the others (and comes back by itself once its ranks are whole again)."""
        for name, addresses in self.config.groups.items():
            self._add_group(name, addresses)

    def _add_group(self, name: str, addresses: tuple[str, ...]) -> None:
        cfg = self.config
        runner = GroupRunner(name, list(addresses), self.metrics, self._dispatch, self._replay, self._group_up,
                             cfg.stall_threshold, cfg.dead_rank_timeout, cfg.rank_auth, cfg.overlap)
        runner.start(self._make_scheduler)
        self.groups[name] = runner
        self.group_addresses[name] = tuple(addresses)

    async def apply_groups(self, listed: dict[str, tuple[str, ...]]) -> GroupsDiff:
        """Make the running groups the listed ones without a restart (a restart drops every group's requests):
        new groups start as at start-up; a group no longer listed (or listed at new addresses) first has its
        requests moved to the other groups, as a drain with migrate does, then stops and leaves /health and
        /metrics. Returns once done; the changes are applied one after another."""
        async with self._regrouping:
            diff = diff_groups(self.group_addresses, listed)
            for name, addresses in diff.added.items():
                log.info("group %s added at %s", name, ",".join(addresses))
                self._add_group(name, addresses)
            for name in (*diff.removed, *diff.changed):
                await self._remove_group(name)
            for name, addresses in diff.changed.items():
                log.info("group %s back at its new addresses %s", name, ",".join(addresses))
                self._add_group(name, addresses)
            return diff

    async def _remove_group(self, name: str) -> None:
        """Stop routing to the group at once, move what it holds to the serving groups at its next step
        boundary (parked for `replay_timeout` when none can take it), then stop it and forget its series."""
        runner = self.groups[name]
        self._leaving.add(name)
        log.warning("group %s removed from the group list: moving its %d request(s) to the other groups",
                    name, runner.load)
        await runner.drain(migrate=True)  # a group that is down holds nothing: its requests moved already
        await runner.close()
        del self.groups[name], self.group_addresses[name]
        self._leaving.discard(name)
        self.router.forget(name)
        forget_group_series(self.metrics, name)
        log.info("group %s removed", name)

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
            if info.sliding_window != infos[0].sliding_window or dict(info.pools).keys() != dict(infos[0].pools).keys():
                raise ValueError(f"rank {r} has pools {dict(info.pools)} (window {info.sliding_window}), rank 0 "
                                 f"{dict(infos[0].pools)} (window {infos[0].sliding_window})")
            if info.page_bytes != infos[0].page_bytes:  # a rebalance trades pages at rank 0's prices
                raise ValueError(f"rank {r} prices a page at {dict(info.page_bytes)} bytes, rank 0 at "
                                 f"{dict(infos[0].page_bytes)}")
        return Scheduler(
            page_size=cfg.page_size,
            salt=key_salt(infos[0].model_id, cfg.page_size),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            ranks=len(infos),
            prefix_caching=cfg.prefix_caching,
            max_model_len=min([self.max_model_len, *(i.max_model_len for i in infos)]),
            window=infos[0].sliding_window,
            rebalancer=self._rebalancer(infos),
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        )

    def _rebalancer(self, infos: list[RankInfo]) -> Rebalancer | None:
        """A group of two pools gets its own rebalance decision (groups never agree with each other)."""
        window, cost = infos[0].sliding_window, dict(infos[0].page_bytes)
        if not window or set(cost) != {POOL_FULL, POOL_SLIDING}:
            return None
        max_len = min([self.max_model_len, *(i.max_model_len for i in infos)])
        return Rebalancer(self.config.rebalance_policy, self.config.page_size, window, cost, max_len)

    def healthy(self) -> bool:
        """Readiness (/health 200, gRPC SERVING): some group is up, so requests are served now (a group that is
        down has its requests moved to one that is up). A group that is up but drained counts too: the operator
        reaches /admin/resume through the same Service, which a not-ready coordinator drops out of, so
        readiness on `serving` would strand a deployment whose every group it drained."""
        return any(g.up for g in self.groups.values())

    def health_detail(self) -> dict:
        """Per group: up, why not, its step, whether it is drained (an operator that restarted reads it here),
        whether it takes new requests now (`serving`: up and not drained), and `requests_in_flight`: the
        coordinator's records of requests on it, parked ones included (0 on every group once all ended: soak
        tests check that no record leaked; a parked request counts on the group it left). The body stays one
        entry per group, which its readers expect."""
        in_flight = dict.fromkeys(self.groups, 0)
        for live in self.live.values():
            if live.group in in_flight:
                in_flight[live.group] += 1
        return {name: {"up": g.up, "reason": g.down_reason, "step": g.step, "draining": g.draining,
                       "serving": g.serving, "requests_in_flight": in_flight[name]}
                for name, g in self.groups.items()}

    def metrics_text(self) -> bytes:
        held = dict.fromkeys(self.groups, 0)  # requests waiting for a group to come back, on the group they left
        for rid in self._parked:
            live = self.live.get(rid)
            if live is not None and live.group in held:
                held[live.group] += 1
        for name, g in self.groups.items():
            waiting, running = g.counts()
            self.metrics.requests.labels(name, "waiting").set(waiting + held[name])
            self.metrics.requests.labels(name, "running").set(running)
        return self.metrics.render()

    async def reset_prefix_cache(self, rank: int | None) -> None:
        flushed = [g for g in self.groups.values() if g.up]
        try:
            await asyncio.gather(*(g.flush(rank) for g in flushed))
        except GroupDown as exc:
            raise ApiError(503, f"the flush did not complete: {exc}", code="group_unavailable",
                           err_type="service_unavailable") from exc
        finally:
            for g in flushed:  # a group agrees on what all its ranks hold: one flushed rank spoils its prefixes
                self.router.forget(g.name)

    async def drain(self, group: str, migrate: bool = False) -> dict:
        """Stop routing new requests to `group` and return once it holds nothing (with `migrate`, its
        requests move to other groups at the next step boundary). KeyError: no such group."""
        runner = self.groups[group]
        started = time.monotonic()
        await runner.drain(migrate)
        return {"group": group, "draining": runner.draining, "holds_nothing": runner.holds_nothing,
                "waited_s": round(time.monotonic() - started, 3)}

    def resume(self, group: str) -> dict:
        """Route new requests to `group` again. KeyError: no such group (or one leaving the group list, which
        must take nothing new: it stops once it holds nothing)."""
        if group in self._leaving:
            raise KeyError(group)
        runner = self.groups[group]
        runner.resume()
        if runner.serving:
            self._group_up(group)  # requests parked while it drained (and no other group could take them)
        return {"group": group, "draining": False}

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
        """A group went down: its requests go on in other groups that are up, recomputed from what they had.
        Those no group can take now wait up to `replay_timeout` for one (the operator, or `lockstep serve`,
        recreates a broken group), and past it end with a retriable error."""
        self.router.forget(group)  # it comes back with new ranks (or moved its requests off): no prefix counts
        self._place([r for r in requests if r.request_id in self.live], reason, exclude=group)

    def _place(self, requests: list[Request], reason: str, exclude: str = "") -> None:
        """Hand requests (oldest first) to the least-loaded serving groups that can hold them; park the rest."""
        targets = [g for g in self.groups.values() if g.serving and g.name != exclude]
        moves: dict[str, list[Request]] = {}
        for req in requests:
            fitting = [g for g in targets if not g.cannot_hold(req)]
            if not fitting:
                self._park(req, reason)
                continue
            target = min(fitting, key=lambda g: g.load + len(moves.get(g.name, ())))
            moves.setdefault(target.name, []).append(req)
        for name, reqs in moves.items():
            self.groups[name].adopt(reqs)
            for req in reqs:
                self._unpark(req.request_id)
                live = self.live[req.request_id]
                if live.group != name:  # a group back up that takes its own requests again moved none
                    log.warning("request %s moves from group %s to %s after %d token(s)", req.request_id,
                                live.group, name, len(req.generated))
                    if live.group in self.groups:  # a group removed has no series left to count on
                        self.metrics.requests_migrated.labels(live.group).inc()
                else:
                    log.info("request %s goes on in group %s, back up, after %d token(s)", req.request_id, name,
                             len(req.generated))
                self.metrics.routing_decisions.labels(name, "replay").inc()
                live.group = name
                live.expected_hit_tokens = 0  # routing expected nothing of this group: no expectation to settle
                # the new group recomputes the request's tokens so far: a request sharing them should follow
                self.router.record(self._routing_keys(req.token_ids()), name)

    def _park(self, req: Request, reason: str) -> None:
        if req.request_id in self._parked:
            return
        if self.config.replay_timeout <= 0:
            self._fail(req, reason)
            return
        timer = asyncio.get_running_loop().call_later(self.config.replay_timeout, self._expire, req.request_id)
        self._parked[req.request_id] = (req, reason, timer)

    def _unpark(self, request_id: str) -> None:
        """The request is held no more: its timer goes with it (a later hold has its own)."""
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            parked[2].cancel()

    def _fail(self, req: Request, reason: str) -> None:
        live = self.live.get(req.request_id)
        if live is not None:
            self.metrics.requests_dropped.labels(live.group).inc()
            live.queue.put(TokenEvent(None, None, req.cached_tokens, error=reason))

    def _group_up(self, group: str) -> None:
        """A group (re)formed: the requests waiting for one go on there, oldest first."""
        for listener in self.group_up_listeners:
            listener(group)
        for rid in [rid for rid in self._parked if rid not in self.live]:
            self._unpark(rid)
        by_reason: dict[str, list[Request]] = {}
        for req, reason, _ in self._parked.values():
            by_reason.setdefault(reason, []).append(req)
        for reason, reqs in by_reason.items():
            self._place(reqs, reason)

    def _expire(self, request_id: str) -> None:
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            req, reason, _ = parked
            self._fail(req, f"{reason}; no group came back within {self.config.replay_timeout:.0f} s")

    def _routing_keys(self, tokens: tuple[int, ...] | list[int]) -> list[bytes]:
        """The routing map's page keys of these tokens: none under the least-loaded policy, which reads none, nor with
        one group, where there is nothing to choose (a group added later starts the map)."""
        if not self.router.wants_keys or len(self.groups) < 2:
            return []
        return page_keys(tokens[: self.router.policy.max_pages * self.config.page_size], self.config.page_size,
                         self._routing_salt)

    def _pick_group(self, spec: GenerateSpec) -> tuple[GroupRunner, Route, list[bytes]]:
        """The serving group for a new request, the routing decision, and the prompt's routing page keys (to
        record once the group took the request): coordinator/routing.py decides, from load and prefixes."""
        keys = self._routing_keys(spec.prompt_ids)
        need = len(spec.prompt_ids) + (spec.max_tokens - 1 if spec.max_tokens_given else 0)
        loads = [GroupLoad(name, g.load, g.serving, g.capacity_tokens) for name, g in self.groups.items()]
        route = self.router.choose(keys, loads, len(spec.prompt_ids), need)
        if route is None:
            reasons = "; ".join(f"group {g.name} is draining" if g.draining and g.up else g.down_reason
                                for g in self.groups.values()) or "no group is up"
            raise ApiError(503, f"no group can serve now ({reasons}); retry later", code="group_unavailable",
                           err_type="service_unavailable")
        return self.groups[route.group], route, keys

    def generate(self, request_id: str, spec: GenerateSpec) -> RequestEvents:
        """Queue the request now (so a refusal is an HTTP status, not an error inside a stream) and
        return its events; closing the iterator early aborts it and frees its pages."""
        queue: Outbox[TokenEvent] = Outbox()
        self.submit(request_id, spec, queue)
        return RequestEvents(self, request_id, queue)

    def submit(self, request_id: str, spec: GenerateSpec, queue: EventSink) -> None:
        """Queue the request now, or raise ApiError; its events go to `queue` (a frontend link's, or the
        Outbox that `generate` reads). Whoever holds the queue ends the request with `_end`."""
        try:
            self._submit(request_id, spec, queue)
        except ApiError as exc:
            if exc.code in REJECTION_REASONS:  # what clients were refused, for an operator (503s above all)
                self.metrics.requests_rejected.labels(exc.code).inc()
            raise

    def _submit(self, request_id: str, spec: GenerateSpec, queue: EventSink) -> None:
        if request_id in self.live:
            raise ApiError(409, f"request id {request_id!r} is already running", "request_id",
                           "request_id_in_use")
        waiting = sum(g.counts()[0] for g in self.groups.values()) + len(self._parked)
        if waiting >= self.config.max_waiting_requests and spec.choice == 0:  # its other choices follow it in
            raise ApiError(503, f"the server is overloaded: {waiting} requests are waiting already "
                                f"(--max-waiting-requests {self.config.max_waiting_requests}); retry later",
                           code="server_overloaded", err_type="service_unavailable")
        group, route, keys = self._pick_group(spec)
        max_tokens = spec.max_tokens
        if not spec.max_tokens_given and group.capacity_tokens:  # "up to the context" means what fits
            max_tokens = max(1, min(max_tokens, group.capacity_tokens - len(spec.prompt_ids)))
        try:
            request = Request(request_id, spec.prompt_ids, spec.sampling, max_tokens, spec.stop_token_ids)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        too_large = group.cannot_hold(request)
        if too_large:  # known before any token: a status, not an error inside a stream
            alone = group.capacity_tokens and len(spec.prompt_ids) > group.capacity_tokens  # too large with 1 token
            raise ApiError(400, too_large, "prompt" if alone else "max_tokens", "request_too_large")
        group.submit(request)
        expected = 0 if request.scoring_prompt or not self.config.prefix_caching else \
            route.expected_hit_tokens(len(spec.prompt_ids), self.config.page_size)
        self.live[request_id] = _Live(request, group.name, queue, time.monotonic(), len(spec.prompt_ids),
                                      expected_hit_tokens=expected)
        self.metrics.routing_decisions.labels(group.name, route.reason).inc()
        self.router.record(keys, group.name)

    def _end(self, request_id: str, finished: bool, stopped: bool = False) -> None:
        """The client's side of a request is over: forget it, and abort it unless it finished. `stopped`: its
        reader ended it at a stop string, so it finished (and is counted so) though its group would go on."""
        live = self.live.pop(request_id, None)
        self._unpark(request_id)  # no group is to take it up any more: no record of it stays
        runner = self.groups.get(live.group) if live is not None else None
        if not finished and runner is not None:
            runner.abort(request_id)
        if stopped and runner is not None:  # a removed group's series are gone: not brought back
            self._observe_finished(live.group, live, time.monotonic())

    def _observe_finished(self, group: str, live: _Live, now: float) -> None:
        self.metrics.request_duration.labels(group).observe(now - live.arrived)
        self.metrics.prompt_tokens.labels(group).inc(live.prompt_tokens)

    def end_streams(self, reason: str) -> None:
        """End every open stream now with an error event and abort its request (a shutdown past its grace)."""
        for request_id, live in list(self.live.items()):
            live.queue.put(TokenEvent(None, None, live.request.cached_tokens, error=reason))
            self._end(request_id, finished=False)

    def _dispatch(self, group: str, events: list[Event]) -> None:
        """A step's events to their clients; inter-token gaps observed once per distinct gap (batch 256)."""
        now = time.monotonic()
        gaps: Counter[float] = Counter()  # by the previous token's time: how many tokens came after it
        tokens = 0
        find, token = self.live.get, EventKind.TOKEN  # looked up once, not per event
        for ev in events:
            live = find(ev.request_id)
            if live is None:
                continue
            if ev.kind == token:
                if live.last_token_at is None:
                    self.metrics.ttft.labels(group).observe(now - live.arrived)
                    self._settle_expectation(group, live)
                else:
                    gaps[live.last_token_at] += 1
                live.last_token_at = now
                tokens += 1
                live.queue.put(token_out(ev.token_id, live.request.cached_tokens, ev.logprobs, ev.prompt_logprobs))
            elif ev.kind == EventKind.FINISHED:
                cached = live.request.cached_tokens
                if ev.finish_reason == FinishReason.ERROR:
                    live.queue.put(TokenEvent(None, None, cached, error=ev.error, status=503 if ev.retriable else 400))
                else:
                    live.queue.put(TokenEvent(None, ev.finish_reason, cached))
                self._observe_finished(group, live, now)
        if tokens:
            self.metrics.generation_tokens.labels(group).inc(tokens)
            itl = self.metrics.itl
            for last, n in gaps.items():
                itl.observe(group, now - last, n)

    def _settle_expectation(self, group: str, live: _Live) -> None:
        """At a request's first token its cached tokens are what its group's ranks agreed on at its first
        admission (the minimum over the ranks): counted against what routing expected, so that an operator
        sees the routing map go stale (a group's ranks evicted, or lost, what the map says they hold)."""
        expected, live.expected_hit_tokens = live.expected_hit_tokens, 0
        if expected > 0:
            self.metrics.routing_expected_hit_tokens.labels(group).inc(expected)
            self.metrics.routing_agreed_hit_tokens.labels(group).inc(min(expected, live.request.cached_tokens))

    async def close(self) -> None:
        for g in self.groups.values():
            await g.close()

