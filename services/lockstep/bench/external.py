"""Any OpenAI-compatible server, loaded by the same client: Lockstep and another engine measured in one run.

Each URL gets the same prompts (text, so a server that takes no token ids is measured too), the same output
length (`ignore_eos` where the server honours it, and `max_tokens` always), the same concurrency, one after
the other. Every request streams, so time to first token and the gaps between tokens are the client's own
clock, as aiperf and guidellm measure them; output tokens are counted from `usage` when the server sends it
(`stream_options.include_usage`), else from the stream's chunks.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from lockstep.bench.report import percentile


@dataclass
class ExternalRun:
    """What one server did with the workload."""

    url: str
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        def pct(values: list[float]) -> dict:
            return {q: 1e3 * percentile(values, q) if values else float("nan") for q in (50, 90, 99)}

        tokens = sum(self.output_tokens)
        return {"url": self.url, "requests": len(self.latency_s), "errors": len(self.errors),
                "output_tok_s": tokens / self.wall_s if self.wall_s else 0.0,
                "req_s": len(self.latency_s) / self.wall_s if self.wall_s else 0.0,
                "ttft_ms": pct(self.ttft_s), "itl_ms": pct(self.itl_s), "latency_ms": pct(self.latency_s)}


@dataclass(frozen=True)
class Target:
    """One server: its base URL (`http://host:port/v1`), the model name it serves, its API key."""

    url: str
    model: str = ""
    api_key: str = ""

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{self.url!r} is not an http(s) URL like http://host:8000/v1")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname, parts.port, timeout=timeout)

    @property
    def path(self) -> str:
        return urllib.parse.urlsplit(self.url).path.rstrip("/") + "/completions"

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"Content-Type": "application/json", "Accept": "text/event-stream", **auth}


def _body(target: Target, prompt: str, max_tokens: int, sampling: dict | None = None) -> dict:
    """A streamed completion's body; `sampling` (the workload's `sampling_of`) replaces greedy's temperature 0."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}} | (sampling or {})
    return {"model": target.model, **body} if target.model else body


def stream_one(target: Target, conn: http.client.HTTPConnection, prompt: str, max_tokens: int,
               sampling: dict | None = None) -> tuple[float, list[float], int, str]:
    """(time to first token, gaps between later chunks, output tokens, text) of one streamed completion."""
    t0 = time.perf_counter()
    conn.request("POST", target.path, body=json.dumps(_body(target, prompt, max_tokens, sampling)).encode(),
                 headers=target.headers())
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times: list[float] = []
    text, chunks, usage = [], 0, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or []:
            if choice.get("text"):
                times.append(time.perf_counter())
                text.append(choice["text"])
                chunks += 1
    resp.read()
    if not times:
        raise RuntimeError("the stream carried no text")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False)], usage or chunks, "".join(text)


def run_external(target: Target, prompts: list[str], max_tokens: int, concurrency: int, warmup: int = 2,
                 timeout_s: float = 600.0, sampling: Callable[[int], dict] | None = None,
                 wait_for: Callable[[int, float], None] | None = None) -> ExternalRun:
    """`concurrency` client threads, each with its own keep-alive connection, stream the prompts in order;
    request i with `sampling(i)`'s fields (greedy when None), not before `wait_for(i, start)` returns."""
    run = ExternalRun(target.url)
    for prompt in prompts[:warmup]:
        conn = target.connection(timeout_s)
        try:
            stream_one(target, conn, prompt[::-1], max_tokens)  # reversed: warms the server, not its cache
        finally:
            conn.close()
    todo = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        conn = target.connection(timeout_s)
        try:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                if wait_for is not None:
                    wait_for(i, start)
                t0 = time.perf_counter()
                try:
                    ttft, gaps, tokens, text = stream_one(target, conn, prompts[i], max_tokens,
                                                          sampling(i) if sampling else None)
                except (OSError, RuntimeError, ValueError) as exc:
                    with lock:
                        run.errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                    conn.close()
                    conn = target.connection(timeout_s)
                    continue
                with lock:
                    run.latency_s.append(time.perf_counter() - t0)
                    run.ttft_s.append(ttft)
                    run.itl_s.extend(gaps)
                    run.output_tokens.append(tokens)
                    run.texts[i] = text
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(min(concurrency, len(prompts)))]
    start = time.perf_counter()  # read by the clients, which start below
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - start
    return run


def format_runs(runs: list[ExternalRun]) -> str:
    """One column per server, the same rows for each."""
    sums = [r.summary() for r in runs]
    width = max(14, *(len(s["url"]) for s in sums))
    lines = [f"{'':<22}" + "".join(f"{s['url']:>{width + 2}}" for s in sums)]

    def row(label: str, values: list[float], fmt: str = "{:.1f}") -> None:
        lines.append(f"{label:<22}" + "".join(f"{fmt.format(v):>{width + 2}}" for v in values))

    row("requests", [s["requests"] for s in sums], "{:.0f}")
    row("errors", [s["errors"] for s in sums], "{:.0f}")
    row("output tok/s", [s["output_tok_s"] for s in sums])
    row("requests/s", [s["req_s"] for s in sums], "{:.2f}")
    for q in (50, 90, 99):
        row(f"TTFT p{q} ms", [s["ttft_ms"][q] for s in sums])
    for q in (50, 90):
        row(f"ITL p{q} ms", [s["itl_ms"][q] for s in sums])
    row("latency p50 ms", [s["latency_ms"][50] for s in sums])
    return "\n".join(lines)
