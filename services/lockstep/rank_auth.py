"""How a coordinator and the ranks of its group trust each other: a shared group token, and optional TLS.

A rank's gRPC port drives its engine: whoever opens a Step stream there supersedes the coordinator's.
So every call to a rank carries the group token as gRPC metadata (`x-lockstep-group-token`), and a
rank that has a token refuses any call without it (UNAUTHENTICATED) before the servicer sees the call.
Only `grpc.health.v1.Health` stays open: the kubelet's gRPC probes cannot send metadata, and a health
answer tells nothing but SERVING or NOT_SERVING. TLS (server certificates, optionally client
certificates) keeps the token and the plans off the wire in clear text.

Both ends read their settings here, because `rank/` and `coordinator/` must not import each other.
The token is read from a file (`--group-token-file`, `LOCKSTEP_GROUP_TOKEN_FILE`) or, when no file is
named, from `LOCKSTEP_GROUP_TOKEN`; it is never a flag, so it never shows on a command line.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from lockstep.settings import Setting

log = logging.getLogger("lockstep.rank_auth")

TOKEN_ENV = "LOCKSTEP_GROUP_TOKEN"
TOKEN_FILE_ENV = "LOCKSTEP_GROUP_TOKEN_FILE"
TOKEN_METADATA_KEY = "x-lockstep-group-token"
OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"  # what a rank answers without the token
REFUSAL_LOG_INTERVAL_S = 10.0

TOKEN_SETTINGS = (
    Setting("group_token_file", "--group-token-file", TOKEN_FILE_ENV,
            help=f"file holding the group token (read once at start; wins over {TOKEN_ENV})"),
)
RANK_TLS_SETTINGS = (
    Setting("tls_cert", "--tls-cert", "LOCKSTEP_TLS_CERT", help="PEM certificate chain: serve gRPC over TLS"),
    Setting("tls_key", "--tls-key", "LOCKSTEP_TLS_KEY", help="PEM private key of --tls-cert"),
    Setting("tls_ca", "--tls-ca", "LOCKSTEP_TLS_CA",
            help="PEM CA bundle: require client certificates signed by it (mutual TLS)"),
)
COORDINATOR_TLS_SETTINGS = (
    Setting("rank_tls_ca", "--rank-tls-ca", "LOCKSTEP_RANK_TLS_CA",
            help="PEM CA bundle that signed the ranks' certificates: talk TLS to the ranks"),
    Setting("rank_tls_cert", "--rank-tls-cert", "LOCKSTEP_RANK_TLS_CERT",
            help="PEM client certificate for ranks that require one (--tls-ca on the rank)"),
    Setting("rank_tls_key", "--rank-tls-key", "LOCKSTEP_RANK_TLS_KEY", help="PEM private key of --rank-tls-cert"),
    Setting("rank_tls_server_name", "--rank-tls-server-name", "LOCKSTEP_RANK_TLS_SERVER_NAME",
            help="the name to verify in every rank's certificate instead of its address's host"),
)
RANK_SETTINGS = TOKEN_SETTINGS + RANK_TLS_SETTINGS
COORDINATOR_SETTINGS = TOKEN_SETTINGS + COORDINATOR_TLS_SETTINGS

_TOKEN = re.compile(r"[\x21-\x7e]+")  # gRPC metadata values are printable ASCII; no spaces, so no stray newline


def check_token(token: str) -> str:
    """Why `token` cannot be a group token, or ""."""
    return "" if _TOKEN.fullmatch(token) else "must be printable ASCII without spaces, and not empty"


def read_token(file: str | None, env: Mapping[str, str]) -> str | None:
    """The group token: the file's content (stripped) when a file is named, else LOCKSTEP_GROUP_TOKEN, else
    None. Raises ValueError naming where a bad token came from; a named file that is empty is an error."""
    if file:
        try:
            token, origin = Path(file).read_text().strip(), f"group token file {file}"
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the group token file {file}: {exc}") from None
    else:
        token, origin = env.get(TOKEN_ENV, "").strip(), TOKEN_ENV
        if not token:
            return None
    problem = check_token(token)
    if problem:
        raise ValueError(f"{origin}: the group token {problem}")
    return token


def new_token() -> str:
    """A random group token, for a launcher that starts a group and its coordinator together."""
    return secrets.token_urlsafe(32)


def env_with_token(token: str, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process that must use `token`: passed by environment, never on a command
    line (which `ps` shows to every user), and with no token file set that would win over it."""
    env = {k: v for k, v in base.items() if k != TOKEN_FILE_ENV}
    env[TOKEN_ENV] = token
    return env


def _pem(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path} holds no PEM block")
    return data


@dataclass(frozen=True)
class RankServerAuth:
    """What a rank asks of its callers: the group token (None: none asked) and its TLS material."""

    token: str | None = field(default=None, repr=False)
    tls_cert: bytes | None = None
    tls_key: bytes | None = field(default=None, repr=False)
    tls_client_ca: bytes | None = None  # set: client certificates signed by it are required

    def credentials(self) -> grpc.ServerCredentials | None:
        """Server TLS credentials, or None for a plaintext port."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)], root_certificates=self.tls_client_ca,
                                           require_client_auth=self.tls_client_ca is not None)


@dataclass(frozen=True)
class RankClientAuth:
    """What a coordinator presents to its ranks: the group token, and how to verify them over TLS."""

    token: str | None = field(default=None, repr=False)
    tls_ca: bytes | None = None  # None with `tls` set: the system's roots
    tls_cert: bytes | None = None
    tls_key: bytes | None = field(default=None, repr=False)
    tls_server_name: str = ""
    tls: bool = False

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call to a rank carries."""
        return ((TOKEN_METADATA_KEY, self.token),) if self.token else ()

    def _secure(self, options: list[tuple[str, Any]]) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
        creds = grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)
        if self.tls_server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]
        return creds, options

    def aio_channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """An asyncio channel to one rank, TLS when configured."""
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, *self._secure(options))

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A blocking channel to one rank (tools and tests), TLS when configured."""
        if not self.tls:
            return grpc.insecure_channel(address, options=options or [])
        return grpc.secure_channel(address, *self._secure(options or []))


def server_auth(values: Mapping[str, Any], env: Mapping[str, str]) -> RankServerAuth:
    """A rank's auth from its resolved RANK_SETTINGS; raises ValueError naming the flag that is wrong."""
    if bool(values.get("tls_cert")) != bool(values.get("tls_key")):
        raise ValueError("--tls-cert and --tls-key (LOCKSTEP_TLS_CERT, LOCKSTEP_TLS_KEY) go together")
    if values.get("tls_ca") and not values.get("tls_cert"):
        raise ValueError("--tls-ca (LOCKSTEP_TLS_CA) asks for client certificates, which needs --tls-cert/--tls-key")
    return RankServerAuth(
        token=read_token(values.get("group_token_file"), env),
        tls_cert=_pem(values.get("tls_cert"), "--tls-cert"),
        tls_key=_pem(values.get("tls_key"), "--tls-key"),
        tls_client_ca=_pem(values.get("tls_ca"), "--tls-ca"),
    )


def client_auth(values: Mapping[str, Any], env: Mapping[str, str]) -> RankClientAuth:
    """A coordinator's auth from its resolved COORDINATOR_SETTINGS; raises ValueError naming the flag."""
    if bool(values.get("rank_tls_cert")) != bool(values.get("rank_tls_key")):
        raise ValueError("--rank-tls-cert and --rank-tls-key (LOCKSTEP_RANK_TLS_CERT, LOCKSTEP_RANK_TLS_KEY) "
                         "go together")
    tls = bool(values.get("rank_tls_ca") or values.get("rank_tls_cert"))
    if values.get("rank_tls_server_name") and not tls:
        raise ValueError("--rank-tls-server-name (LOCKSTEP_RANK_TLS_SERVER_NAME) needs --rank-tls-ca")
    return RankClientAuth(
        token=read_token(values.get("group_token_file"), env),
        tls_ca=_pem(values.get("rank_tls_ca"), "--rank-tls-ca"),
        tls_cert=_pem(values.get("rank_tls_cert"), "--rank-tls-cert"),
        tls_key=_pem(values.get("rank_tls_key"), "--rank-tls-key"),
        tls_server_name=values.get("rank_tls_server_name") or "",
        tls=tls,
    )


def token_matches(expected: bytes, metadata: Any) -> bool:
    """Whether the call's metadata carries the token; compared in constant time."""
    given = [v for k, v in metadata or () if k == TOKEN_METADATA_KEY]
    return any(hmac.compare_digest(expected, v.encode() if isinstance(v, str) else v) for v in given)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but the health check that lacks the group token, before the servicer runs: an
    unauthenticated Step stream never reaches the rank, so it can never supersede the coordinator's."""

    def __init__(self, token: str, what: str = "this rank") -> None:
        self._expected = token.encode()
        self._what = what
        self._lock = threading.Lock()
        self._refused = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL_S

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_METHODS_PREFIX) or token_matches(
                self._expected, details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        if handler is None:  # an unknown method: UNIMPLEMENTED tells nothing
            return None
        self._note(details.method)

        def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong group token ({TOKEN_METADATA_KEY})")

        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}
        return kind[(handler.request_streaming, handler.response_streaming)](refuse)

    def _note(self, method: str) -> None:
        """Log refusals, at most one line per interval, so a scanner cannot flood the log."""
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._logged_at < REFUSAL_LOG_INTERVAL_S:
                return
            count, self._refused, self._logged_at = self._refused, 0, now
        log.warning("%s refused %d call(s) without the right group token (latest: %s)", self._what, count, method)
