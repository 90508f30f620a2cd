"""API keys: who may use the inference and operator APIs.

One rule for both front ends: with keys configured, a call must carry `Authorization: Bearer KEY` (HTTP
header or gRPC metadata) for one of them. Keys are compared in constant time, every key every time, so
neither the time of a refusal nor which key came closest tells a caller anything. No key configured means
an open API (a laptop, a test); `lockstep coordinator` and `lockstep serve` say so in the log. Which HTTP
paths stay open (probes, scrapers, discovery) is openapi.py's OPEN_PATHS: every other path needs a key.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}


def check_api_key(key: str) -> str:
    """A key as configured: printable ASCII without spaces or commas (it travels in a header and is listed
    comma-separated in LOCKSTEP_API_KEY); ValueError otherwise, without echoing the key."""
    if not key or not set(key) <= _KEY_CHARS:
        raise ValueError("an API key must be non-empty printable ASCII without spaces or commas")
    return key


def parse_api_keys(flags: Iterable[str], env_value: str = "") -> tuple[str, ...]:
    """The keys of `--api-key` flags (repeatable), else of LOCKSTEP_API_KEY (comma-separated)."""
    keys = list(flags) or [k.strip() for k in env_value.split(",") if k.strip()]
    return tuple(dict.fromkeys(check_api_key(k) for k in keys))


class ApiKeys:
    """The configured keys; `allows` is the one check both APIs make."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value ("Bearer KEY") names a configured key (always, with no keys)."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        given = token.strip().encode("utf-8", "replace")
        ok = False
        for key in self._keys:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(key, given)
        return ok and scheme.lower() == "bearer"
