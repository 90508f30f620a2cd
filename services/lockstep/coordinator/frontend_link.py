"""The coordinator's end of the frontend link: requests from API frontend processes, one message per step back.

With `--api-workers N` the HTTP API runs in N frontend processes (remote.py). Their requests are queued here
exactly as the in-process API's are (`Coordinator.submit`), but a request's events go to its frontend's
`Link` instead of an Outbox read by an HTTP task: the step's dispatch appends them to the link's list, and
one callback after the dispatch sends the whole list as one columnar message. What stays on the coordinator's
event loop per streamed token is an append and three column entries; parsing, detokenizing, stop strings,
JSON and the socket writes run in the frontends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from lockstep.coordinator.frontend_wire import (
    MAX_MESSAGE,
    MESSAGE_BUDGET,
    answer_of,
    events_to_proto,
    spec_from_proto,
    split_events,
)
from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.service import Coordinator
from lockstep.proto_gen.lockstep.v1 import frontend_pb2 as fpb
from lockstep.proto_gen.lockstep.v1 import frontend_pb2_grpc
from lockstep.wire import WireError

log = logging.getLogger("lockstep.link")

# A frontend that takes nothing off its link for this long while events wait for it, or has left this many bytes
# of them waiting, is wedged (alive, its stream open, reading nothing): its requests are aborted, what waits for
# it is dropped, and its process is killed and started again (ApiWorkers), so neither the coordinator's memory
# nor the ranks' pages grow behind it. gRPC's own buffers take the first few MB; the wait counts from when they
# are full. The byte cap is twice the largest message, so one step's events never trip it alone.
LINK_STALL_S = 60.0
LINK_BACKLOG_BYTES = 2 * MAX_MESSAGE


class Link:
    """One frontend's requests and the events bound for it."""

    def __init__(self, coordinator: Coordinator, link_id: str, pid: int = 0,
                 on_wedged: Callable[[Link], None] | None = None) -> None:
        self.coordinator = coordinator
        self.link_id = link_id
        self.pid = pid  # the frontend's process, when it said (LinkHello.pid)
        self.on_wedged = on_wedged
        self.requests: set[str] = set()  # submitted, not ended
        self.out: asyncio.Queue[tuple[fpb.StepEventsMsg, int] | None] = asyncio.Queue()  # (message, bytes); None: end
        self.backlog = 0  # bytes of the messages in `out`
        self.taken_at = time.monotonic()  # when the stream last took a message or had none waiting
        self.wedged = ""  # why the link takes no more: the frontend stopped reading
        self._pending: list[tuple[str, TokenEvent]] = []

    def submit(self, request_id: str, spec: GenerateSpec) -> None:
        """Queue the request on the coordinator (or raise its ApiError) with this link as its events' sink."""
        self.coordinator.submit(request_id, spec, LinkQueue(self, request_id))
        self.requests.add(request_id)

    def add(self, request_id: str, ev: TokenEvent) -> None:
        if not self._pending:  # the first event of this dispatch: send them all once it is over
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((request_id, ev))

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        for rid, ev in events:
            if (ev.finish_reason is not None or ev.error) and rid in self.requests:
                self.requests.discard(rid)
                self.coordinator._end(rid, finished=True)
        if self.wedged:
            return
        if self.out.empty():  # the stream has taken everything so far: it is not behind
            self.taken_at = time.monotonic()
        waiting = self.backlog  # before this step's: what the stream has not taken since earlier steps
        for part in split_events(events, MESSAGE_BUDGET):
            msg = events_to_proto(part)
            size = msg.ByteSize()
            self.backlog += size
            self.out.put_nowait((msg, size))
        stalled = time.monotonic() - self.taken_at
        if waiting > LINK_BACKLOG_BYTES or stalled > LINK_STALL_S:
            self._wedge(f"frontend {self.link_id} read nothing of its link for {stalled:.1f} s with "
                        f"{self.out.qsize()} messages ({self.backlog} bytes) waiting for it")

    def taken(self, size: int) -> None:
        """The stream took a message of `size` bytes off `out`."""
        self.backlog -= size
        self.taken_at = time.monotonic()

    def _wedge(self, why: str) -> None:
        """Abort every request of a frontend that stopped reading, refuse its new ones, drop what waits for it, and
        end its stream should it read again; its process is killed and started again (`on_wedged`)."""
        log.error("%s: its %d request(s) are aborted and the link is closed", why, len(self.requests))
        self.wedged = why
        self.close()
        while not self.out.empty():
            self.out.get_nowait()
        self.backlog = 0
        self.out.put_nowait(None)
        if self.on_wedged is not None:
            self.on_wedged(self)

    def cancel(self, request_id: str, stopped: bool = False) -> None:
        if request_id in self.requests:
            self.requests.discard(request_id)
            self.coordinator._end(request_id, finished=False, stopped=stopped)

    def close(self) -> None:
        """The frontend is gone: every request it has not seen end is aborted, its pages freed."""
        for rid in list(self.requests):
            self.cancel(rid)


class LinkQueue:
    """A request's event sink: its frontend's link (in place of the Outbox an in-process client reads)."""

    __slots__ = ("link", "request_id")

    def __init__(self, link: Link, request_id: str) -> None:
        self.link, self.request_id = link, request_id

    def put(self, item: TokenEvent) -> None:
        self.link.add(self.request_id, item)


class FrontendLinkServicer(frontend_pb2_grpc.FrontendLinkServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.links: dict[str, Link] = {}
        self.on_wedged: Callable[[Link], None] | None = None  # told of a frontend that stopped reading its link
        self.beats: dict[int, float] = {}  # a frontend process's last sign of life (time.monotonic()), by pid

    async def Events(self, request: fpb.LinkHello, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[fpb.StepEventsMsg]:
        if not request.link_id or request.link_id in self.links:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"link id {request.link_id!r} is empty or in use")
        link = self.links[request.link_id] = Link(self.coordinator, request.link_id, request.pid, self.on_wedged)
        self.beats[request.pid] = time.monotonic()
        log.info("frontend %s linked", request.link_id)
        try:
            yield fpb.StepEventsMsg()  # linked: the frontend submits only after this
            while (item := await link.out.get()) is not None:
                link.taken(item[1])
                yield item[0]
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, link.wedged)
        finally:
            del self.links[request.link_id]
            log.info("frontend %s unlinked: %d request(s) of it aborted", request.link_id, len(link.requests))
            link.close()

    async def Submit(self, request: fpb.SubmitMsg, context: grpc.aio.ServicerContext) -> fpb.SubmitAnswer:
        link = self.links.get(request.link_id)
        if link is None or link.wedged:  # a frontend that is being started again: its clients retry
            self.coordinator.metrics.requests_rejected.labels("frontend_unlinked").inc()
            return answer_of(ApiError(503, "the frontend's link to the coordinator is not open; retry",
                                      code="frontend_unlinked", err_type="service_unavailable"))
        try:
            link.submit(request.request_id, spec_from_proto(request))
        except WireError as exc:
            return answer_of(ApiError(400, str(exc)))
        except ApiError as exc:
            return answer_of(exc)
        return answer_of(None)

    async def Cancel(self, request: fpb.CancelMsg, context: grpc.aio.ServicerContext) -> fpb.Empty:
        link = self.links.get(request.link_id)
        if link is not None:
            link.cancel(request.request_id, request.stopped)
        return fpb.Empty()

    async def Beat(self, request: fpb.LinkHello, context: grpc.aio.ServicerContext) -> fpb.Empty:
        self.beats[request.pid] = time.monotonic()
        return fpb.Empty()

    async def Describe(self, request: fpb.Empty, context: grpc.aio.ServicerContext) -> fpb.Description:
        c = self.coordinator
        return fpb.Description(model_name=c.model_name, max_model_len=c.max_model_len, max_logprobs=c.max_logprobs)

    async def Health(self, request: fpb.Empty, context: grpc.aio.ServicerContext) -> fpb.JsonAnswer:
        detail = self.coordinator.health_detail()
        return fpb.JsonAnswer(status=200 if self.coordinator.healthy() else 503, json=json.dumps(detail))

    async def Metrics(self, request: fpb.Empty, context: grpc.aio.ServicerContext) -> fpb.MetricsAnswer:
        return fpb.MetricsAnswer(text=self.coordinator.metrics_text())

    async def Admin(self, request: fpb.AdminCall, context: grpc.aio.ServicerContext) -> fpb.JsonAnswer:
        """An /admin route's answer; KeyError (no such group) is a 404, ValueError (a bad rank) a 400."""
        c = self.coordinator
        try:
            if request.name == "reset_prefix_cache":
                await c.reset_prefix_cache(request.rank if request.HasField("rank") else None)
                out: dict = {}
            elif request.name == "step_log":
                out = c.step_log(request.group or None, request.since)
            elif request.name == "drain":
                out = await c.drain(request.group, request.migrate)
            elif request.name == "resume":
                out = c.resume(request.group)
            else:
                return fpb.JsonAnswer(status=400, json=json.dumps(f"no admin call {request.name!r}"))
        except ApiError as exc:  # e.g. a reset while a group is down: 503 with Retry-After, as in process
            return fpb.JsonAnswer(status=exc.status, error=answer_of(exc))
        except KeyError as exc:
            return fpb.JsonAnswer(status=404, json=json.dumps(str(exc)))
        except ValueError as exc:
            return fpb.JsonAnswer(status=400, json=json.dumps(str(exc)))
        return fpb.JsonAnswer(status=200, json=json.dumps(out))


async def start_link(coordinator: Coordinator, address: str) -> tuple[grpc.aio.Server, FrontendLinkServicer]:
    """Serve the link at `address` (a `unix:` path in a directory only this user can enter: the frontends are
    this deployment's own processes, and the link carries no API key)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE)])
    servicer = FrontendLinkServicer(coordinator)
    frontend_pb2_grpc.add_FrontendLinkServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server, servicer
