"""The operator's only HTTP calls to a coordinator: drain, resume, its /health and /metrics (aiohttp, async).

Each call has a bounded wait and turns every outcome into an `Answer`, never an exception, so the
decisions in `drain.py` see the same few cases whatever went wrong on the network.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from lockstep_operator.drain import Answer

CONNECT_TIMEOUT_S = 3.0


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _post(url: str, params: dict[str, str], api_key: str, wait_s: float) -> tuple[Answer, str]:
    timeout = aiohttp.ClientTimeout(total=None, connect=min(CONNECT_TIMEOUT_S, wait_s), sock_read=wait_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(url, params=params, headers=_headers(api_key)) as resp:
            text = (await resp.text())[:300]
            if resp.status < 300:
                return Answer.DONE, text
            if resp.status < 500:
                return Answer.REFUSED, f"HTTP {resp.status}: {text}"
            return Answer.UNREACHABLE, f"HTTP {resp.status}: {text}"
    except (TimeoutError, aiohttp.ServerTimeoutError) as e:
        if isinstance(e, aiohttp.ConnectionTimeoutError):
            return Answer.UNREACHABLE, f"connecting to {url} timed out"
        return Answer.PENDING, f"no answer within {wait_s:.1f}s"
    except aiohttp.ClientError as e:
        return Answer.UNREACHABLE, f"{type(e).__name__}: {e}"[:300]


async def drain(root: str, group: str, migrate: bool, api_key: str, wait_s: float) -> tuple[Answer, str]:
    """`POST /admin/drain?group=G[&migrate=true]`, waiting at most `wait_s` for the 200 (PENDING if not)."""
    params = {"group": group} | ({"migrate": "true"} if migrate else {})
    return await _post(f"{root}/admin/drain", params, api_key, wait_s)


async def resume(root: str, group: str, api_key: str, wait_s: float = 5.0) -> tuple[Answer, str]:
    """`POST /admin/resume?group=G`: the coordinator routes to G again."""
    return await _post(f"{root}/admin/resume", {"group": group}, api_key, wait_s)


async def metrics(root: str, wait_s: float = 3.0) -> str | None:
    """The coordinator's /metrics text (open, no key), or None when it cannot be read."""
    timeout = aiohttp.ClientTimeout(total=wait_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(f"{root}/metrics") as resp:
            return await resp.text() if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


async def health(root: str, wait_s: float = 3.0) -> dict[str, Any] | None:
    """The coordinator's /health body (open, no key): per group up, reason, step, draining. Its 503 (no
    group can serve) carries the same body; None when it cannot be read or is not that shape."""
    timeout = aiohttp.ClientTimeout(total=wait_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(f"{root}/health") as resp:
            body = json.loads(await resp.text()) if resp.status in (200, 503) else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    return body if isinstance(body, dict) else None
