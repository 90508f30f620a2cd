"""What every Lockstep gRPC server is told: its port is its own, and when a peer that answers nothing is dropped.

A port of its own: grpc's servers set SO_REUSEPORT by default, so a second rank started on a port that a stale
rank still holds would bind as well, and the kernel would deal the coordinator's connections between the two:
plans reaching a process that is not in the group. With the option off, the second one fails to start.

Keepalive: how a server drops a peer that answers nothing any more (stopped, cut off without a FIN or an RST),
so that what the peer held (a rank's Step stream, a client's request) is let go. grpc >= 1.5x times an
unanswered ping by `grpc.http2.ping_timeout_ms` (60 s by default), not by `grpc.keepalive_timeout_ms` alone:
both are set, or a silent peer is held for a minute more than asked.
"""

from __future__ import annotations

from typing import Any

import grpc

EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
# How often a client may ping a server that pings its peers. grpc's servers allow a client's ping once per 5 minutes
# while no data flows and answer the third one sooner with GOAWAY "too_many_pings": a client with keepalive every
# 10-30 s (Go's and Java's shortest is 10 s; clients set it to keep a load balancer's idle timeout off) lost its
# long Complete call, which sends nothing until its generation ends, as UNAVAILABLE after a minute or two.
MIN_CLIENT_PING_MS = 5_000


def server_options(keepalive_ms: int | None = None) -> list[tuple[str, int]]:
    """A port of its own and, with `keepalive_ms`, a ping every `keepalive_ms`; a peer that leaves one unanswered
    for as long is dropped, and one that pings at most every MIN_CLIENT_PING_MS is let be."""
    if keepalive_ms is None:
        return [EXCLUSIVE_PORT]
    return [EXCLUSIVE_PORT, ("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.http2.ping_timeout_ms", keepalive_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS)]


def host_port(host: str, port: int) -> str:
    """gRPC's address of a host and port: an IPv6 literal in brackets ("::" alone read as a host without a port,
    so `--host ::` could not bind the coordinator's gRPC port at all)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_port(server: Any, address: str, what: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `server` (sync or aio) to `address`, and the port it got; an OSError naming `what` where it cannot."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise OSError(f"cannot bind {what} to {address}: {e}") from e
    if port == 0:
        raise OSError(f"cannot bind {what} to {address}")
    return port
