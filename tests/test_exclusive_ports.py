"""A Lockstep gRPC server's port is its own. grpc's servers set SO_REUSEPORT unless told not to, so a second
rank started on a port a stale rank still holds would bind too, and the kernel would share the coordinator's
connections between them: plans to a process that is not in the group. The second one must fail to start."""

from __future__ import annotations

import asyncio

import pytest

from lockstep.coordinator.grpc_api import start_grpc
from lockstep.rank.service import RankServer, RankServicer
from test_generation import FakeFrontend
from test_request_edge import _free_port


def test_a_second_rank_on_a_held_port_fails_to_start():
    first = RankServer(RankServicer(0), "127.0.0.1:0", health_address="127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            RankServer(RankServicer(0), f"127.0.0.1:{first.port}")
        with pytest.raises(OSError, match="health port"):
            RankServer(RankServicer(0), "127.0.0.1:0", health_address=f"127.0.0.1:{first.health_port}")
    finally:
        first.stop(grace=0)


def test_a_second_coordinator_grpc_server_on_a_held_port_fails_to_start():
    async def go() -> None:
        port = _free_port()
        first = await start_grpc(FakeFrontend([]), "127.0.0.1", port)
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await start_grpc(FakeFrontend([]), "127.0.0.1", port)
        finally:
            await first.stop(0)

    asyncio.run(go())
