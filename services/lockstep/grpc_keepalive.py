"""Server keepalive: how a gRPC server drops a peer that answers nothing any more (stopped, cut off without a FIN
or an RST), so that what the peer held (a rank's Step stream, a client's request) is let go.

grpc >= 1.5x times an unanswered ping by `grpc.http2.ping_timeout_ms` (60 s by default), not by
`grpc.keepalive_timeout_ms` alone: both are set, or a silent peer is held for a minute more than asked.
"""

from __future__ import annotations


def keepalive_options(ms: int) -> list[tuple[str, int]]:
    """A ping every `ms`; a peer that leaves one unanswered for `ms` is dropped."""
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms), ("grpc.http2.ping_timeout_ms", ms)]
