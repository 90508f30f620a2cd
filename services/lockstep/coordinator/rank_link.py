"""The coordinator's end of one rank: its Step stream, its Info call and its health check.

Plans are written by a task of their own, off the step loop, and reports (or the reason the stream
ended) land in the group's inbox as `(rank, Report | str)`. Protobuf stops here: what leaves this
module is the cores' plain data. Every call carries the group token (`rank_auth`), and the channel
speaks TLS when the coordinator was given the ranks' CA.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lockstep import wire
from lockstep.proto_gen.lockstep.v1 import rank_pb2, rank_pb2_grpc
from lockstep.rank_auth import RankClientAuth
from lockstep.steps import Plan, RankInfo
from lockstep.stream_metadata import COORDINATOR_METADATA

MAX_MESSAGE = 64 << 20  # a report carries a whole step's probe answers
# This coordinator process, as its Step streams name it: a rank driven by it takes its reconnects and refuses
# another coordinator's streams (COORDINATOR_METADATA).
COORDINATOR_ID = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


class RankLink:
    """One rank's channel and Step stream, as the group's step loop uses them."""

    def __init__(self, rank: int, address: str, auth: RankClientAuth | None = None,
                 coordinator_id: str = COORDINATOR_ID) -> None:
        self.rank = rank
        self.address = address
        auth = auth or RankClientAuth()
        self.metadata = (*auth.metadata(), (COORDINATOR_METADATA, coordinator_id))
        self.channel = auth.aio_channel(address, [("grpc.max_receive_message_length", MAX_MESSAGE)])
        self.stub = rank_pb2_grpc.RankServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.call = None
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    async def info(self, timeout: float = 2.0) -> RankInfo:
        """What the rank serves and the last step it carried out; raises grpc.aio.AioRpcError if it is away."""
        reply = await self.stub.Info(rank_pb2.InfoRequest(), timeout=timeout, metadata=self.metadata)
        return wire.info_from_proto(reply)

    async def responsive(self, timeout: float = 1.0) -> bool:
        """Whether the rank's process answers at all: a rank blocked in a collective still does, a stopped
        or hung process does not. This tells the operator which rank holds the others up."""
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout, metadata=self.metadata)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def open(self, inbox: asyncio.Queue) -> None:
        """A new Step stream (the rank ends any older one) whose reports go to `inbox`."""
        self.stop()
        self.call = self.stub.Step(metadata=self.metadata)
        self.outbox = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._read(inbox)), loop.create_task(self._write(self.call, self.outbox, inbox))]

    async def _read(self, inbox: asyncio.Queue) -> None:
        try:
            async for msg in self.call:
                await inbox.put((self.rank, wire.report_from_proto(msg)))
            reason = "its stream ended"
        except grpc.aio.AioRpcError as exc:
            reason = f"its stream broke: {exc.code().name} {exc.details()}"
        except asyncio.CancelledError:
            return
        await inbox.put((self.rank, reason))

    async def _write(self, call, outbox: asyncio.Queue, inbox: asyncio.Queue) -> None:
        """Write queued plans in order, off the step loop: the loop waits for reports, not for writes."""
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            return
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError) as exc:
            await inbox.put((self.rank, f"its stream broke while sending: {exc}"))

    @property
    def streaming(self) -> bool:
        return self.call is not None

    def send(self, plan: Plan | rank_pb2.PlanMsg) -> None:
        """Queue a plan (or one already serialized for every rank) for the writer task."""
        self.outbox.put_nowait(plan if isinstance(plan, rank_pb2.PlanMsg) else wire.plan_to_proto(plan))

    def stop(self) -> None:
        """End the Step stream, so the rank is free for another coordinator."""
        if self.call is not None:
            self.call.cancel()
        for task in self.tasks:
            task.cancel()

    async def close(self) -> None:
        self.stop()
        await self.channel.close()
