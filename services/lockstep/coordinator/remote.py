"""An API frontend process: the OpenAI HTTP API in front of a coordinator in another process.

`lockstep serve --api-workers N` (and the coordinator's `--api-workers`) start N of these on the HTTP port
(SO_REUSEPORT: the kernel spreads the connections over them; the coordinator reserves the port, api_workers.py).
Each holds one link to the coordinator (frontend_link.py): a request is submitted with one call (a refusal is an
HTTP status, as in process), its tokens come back in the one message per step the link sends, and everything per
token (detokenizing, stop strings, JSON, the socket write) runs here. `RemoteCoordinator` is the `Frontend` the
HTTP app is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import uuid

import grpc

from lockstep.coordinator.auth import parse_api_keys
from lockstep.coordinator.frontend_wire import MAX_MESSAGE, error_of, events_from_proto, spec_to_proto
from lockstep.coordinator.generation import ApiError, GenerateSpec, TokenEvent
from lockstep.coordinator.openai_api import KEEP_ALIVE_S, SHUTDOWN_GRACE_S, OpenAIServer, run_app
from lockstep.coordinator.outbox import Outbox
from lockstep.coordinator.request_events import RequestEvents
from lockstep.model.config import ModelConfig
from lockstep.proto_gen.lockstep.v1 import frontend_pb2 as fpb
from lockstep.proto_gen.lockstep.v1 import frontend_pb2_grpc
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.frontend")
_GONE = ("the link between this API frontend and the coordinator closed (the coordinator went away, or dropped "
         "this frontend)")
FRONTEND_BEAT_S = 1.0  # between heartbeats (the coordinator's FRONTEND_SILENT_S is ten of them)


class RemoteCoordinator:
    """The coordinator, as the HTTP app sees it, over the frontend link."""

    def __init__(self, address: str, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.link_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
        self.stub = frontend_pb2_grpc.FrontendLinkStub(self.channel)
        self.boxes: dict[str, Outbox[TokenEvent]] = {}
        self.model_name, self.max_model_len, self.max_logprobs = "", 0, 0
        self._healthy = False
        self._events: grpc.aio.UnaryStreamCall | None = None
        self._tasks: set[asyncio.Task] = set()

    async def connect(self, timeout_s: float) -> None:
        """Learn what is served and open the link (the coordinator may still be starting: wait for it)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        desc = await self.stub.Describe(fpb.Empty())
        self.model_name, self.max_model_len, self.max_logprobs = desc.model_name, desc.max_model_len, desc.max_logprobs
        self._events = self.stub.Events(fpb.LinkHello(link_id=self.link_id, pid=os.getpid()))
        await asyncio.wait_for(self._events.read(), timeout_s)  # the empty first message: the link is open

    async def pump(self) -> None:
        """Hand each step's events to their requests until the link closes; then every open request ends with
        an error (the coordinator that held it is gone) and this returns."""
        assert self._events is not None
        try:
            while (msg := await self._events.read()) is not grpc.aio.EOF:
                for rid, ev in events_from_proto(msg):
                    box = self.boxes.get(rid)
                    if box is not None:
                        box.put(ev)
        except grpc.aio.AioRpcError as exc:
            log.warning("the link to the coordinator closed: %s", exc.details())
        except Exception:  # a message this frontend cannot read: its streams must not wait for more
            log.exception("a message from the coordinator could not be read; this frontend stops")
        for box in self.boxes.values():
            box.put(TokenEvent(None, None, error=_GONE))
        self.boxes.clear()

    async def beat(self) -> None:
        """Tell the coordinator, from this process's event loop, that it runs: one whose loop stops (stopped,
        wedged) sends nothing, and the coordinator kills it rather than let it take connections it never answers."""
        hello = fpb.LinkHello(link_id=self.link_id, pid=os.getpid())
        while True:
            try:
                await self.stub.Beat(hello, timeout=FRONTEND_BEAT_S * 4)
            except grpc.aio.AioRpcError as exc:  # the coordinator is gone or busy: the pump sees the link's end
                log.debug("a heartbeat was not delivered: %s", exc.details())
            await asyncio.sleep(FRONTEND_BEAT_S)

    async def generate(self, request_id: str, spec: GenerateSpec) -> RequestEvents:
        box: Outbox[TokenEvent] = Outbox()
        self.boxes[request_id] = box  # before the call: the first events may come before its answer
        call = asyncio.ensure_future(self.stub.Submit(spec_to_proto(self.link_id, request_id, spec)))
        try:
            answer = await asyncio.shield(call)
        except asyncio.CancelledError:  # the client went away while it was submitted: abort it once it is
            self.boxes.pop(request_id, None)
            call.add_done_callback(lambda done: self._cancel_if_queued(request_id, done))
            raise
        except grpc.aio.AioRpcError as exc:
            self.boxes.pop(request_id, None)
            raise ApiError(503, f"{_GONE}: {exc.details()}", err_type="service_unavailable") from exc
        if not answer.ok:
            self.boxes.pop(request_id, None)
            raise error_of(answer)
        return RequestEvents(self, request_id, box)

    def _end(self, request_id: str, finished: bool, stopped: bool = False) -> None:
        """A request's events are over (RequestEvents): forget it, and abort it on the coordinator unless it ended
        (or the link already ended it: its box is gone)."""
        if self.boxes.pop(request_id, None) is not None and not finished:
            self._send_cancel(request_id, stopped)

    def _cancel_if_queued(self, request_id: str, submitted: asyncio.Future) -> None:
        if not submitted.cancelled() and submitted.exception() is None and submitted.result().ok:
            self._send_cancel(request_id)

    def _send_cancel(self, request_id: str, stopped: bool = False) -> None:
        task = asyncio.ensure_future(self._cancel(request_id, stopped))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel(self, request_id: str, stopped: bool = False) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.Cancel(fpb.CancelMsg(link_id=self.link_id, request_id=request_id, stopped=stopped))

    def healthy(self) -> bool:
        """As of the last health_detail (the HTTP app asks that first)."""
        return self._healthy

    async def health_detail(self) -> dict:
        """The coordinator's; unreachable, a 502 (not a 503 whose body would read as the groups' state)."""
        answer = await self._call(self.stub.Health(fpb.Empty()), 502)
        self._healthy = answer.status == 200
        return json.loads(answer.json)

    async def metrics_text(self) -> bytes:
        return (await self._call(self.stub.Metrics(fpb.Empty()))).text

    async def _call(self, call, status: int = 503):
        """A unary call's answer; the coordinator unreachable is an API error, not a frontend's 500."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise ApiError(status, f"{_GONE}: {exc.details()}", err_type="service_unavailable") from exc

    async def _admin(self, **call) -> dict:
        answer = await self._call(self.stub.Admin(fpb.AdminCall(**call)))
        if answer.HasField("error"):
            raise error_of(answer.error)
        body = json.loads(answer.json)
        if answer.status == 404:
            raise KeyError(body)
        if answer.status != 200:
            raise ValueError(body)
        return body

    async def reset_prefix_cache(self, rank: int | None) -> None:
        await self._admin(name="reset_prefix_cache", **({} if rank is None else {"rank": rank}))

    async def step_log(self, group: str | None, since: int) -> dict:
        return await self._admin(name="step_log", group=group or "", since=since)

    async def drain(self, group: str, migrate: bool = False) -> dict:
        return await self._admin(name="drain", group=group, migrate=migrate)

    async def resume(self, group: str) -> dict:
        return await self._admin(name="resume", group=group)

    async def close(self) -> None:
        await self.channel.close()


async def serve_frontend(link: str, model_dir: str, host: str, port: int, api_keys: tuple[str, ...],
                         grace: float = SHUTDOWN_GRACE_S, connect_timeout_s: float = 600.0,
                         keep_alive: float = KEEP_ALIVE_S) -> int:
    """Serve the HTTP API until SIGTERM / SIGINT or until the link closes (the coordinator stopped): exit 0 for
    a signal, 1 for a lost link, so whoever started this can tell the two apart."""
    tokenizer = Tokenizer.from_dir(model_dir).for_model(ModelConfig.from_dir(model_dir).vocab_size)
    remote = RemoteCoordinator(link, tokenizer)
    await remote.connect(connect_timeout_s)
    runner = await run_app(OpenAIServer(remote, api_keys).app(), host, port, grace, reuse_port=True,
                           keep_alive=keep_alive)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pump = asyncio.ensure_future(remote.pump())
    beat = asyncio.ensure_future(remote.beat())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({pump, waiter}, return_when=asyncio.FIRST_COMPLETED)
    await runner.cleanup()
    pump.cancel()
    beat.cancel()
    waiter.cancel()
    await remote.close()
    return 0 if stop.is_set() else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One API frontend of a Lockstep coordinator (started by it).")
    p.add_argument("--link", required=True, help="the coordinator's frontend link (unix:PATH)")
    p.add_argument("--model", required=True, help="the model directory (its tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="the HTTP port (shared: SO_REUSEPORT)")
    p.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S)
    p.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = parse_api_keys([], os.environ.get("LOCKSTEP_API_KEY", ""))
    return asyncio.run(serve_frontend(args.link, args.model, args.host, args.port, keys, args.shutdown_grace,
                                      keep_alive=args.timeout_keep_alive))


if __name__ == "__main__":
    sys.exit(main())
