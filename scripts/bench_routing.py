"""Prefix-aware routing next to least-loaded routing, on `lockstep serve --dp 2` and a shared-prefix workload.

The workload: a few system prompts (8 of 512 tokens by default), each followed by many user turns of
their own (random 32-96 tokens), sent in one shuffled order by concurrent streaming clients, so every
system prompt is asked for again and again on both routing policies. Each policy gets a fresh
`lockstep serve --dp 2 --tp 1` (its own processes, empty caches) serving the same random Llama
(hidden 512, 6 layers: big enough that a 512-token prefill costs more than the serving overhead on a
CPU, small enough for 2 cores), whose KV pool per rank holds about 3/4 of all the system prompts (a
group's cache is finite, as on a real server: least-loaded routing sends every system prompt to every
group, which then evict each other's; prefix routing keeps each on one group).

Printed side by side: prompt tokens served from the prefix cache / prompt tokens (the clients' own
`usage.prompt_tokens_details.cached_tokens`), TTFT mean / p50 / p90 (client side, first streamed
token), output tokens/s and requests/s over the run, and the coordinator's routing decisions by reason.

    python scripts/bench_routing.py     # 8 x 512-token prompts, 192 turns: about 40 s per policy on 2 cores
    python scripts/bench_routing.py --hidden 256 --layers 4 --requests 96   # a quicker look
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.bench.tiny_model import build_tiny_model
from lockstep.local_group import free_port

POLICIES = ("least-loaded", "prefix")
VOCAB = 384


def build_model(path: Path, hidden: int, layers: int, max_positions: int = 2048) -> Path:
    """A random Llama with a word-level tokenizer (ids w3..w383), made once per shape and reused."""
    if (path / "config.json").is_file():
        return path
    return build_tiny_model(path, hidden=hidden, layers=layers, max_positions=max_positions)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # in the order they are sent
    system_of: list[int]  # which system prompt each request starts with
    max_tokens: int
    concurrency: int


def make_workload(systems: int, system_len: int, requests: int, max_tokens: int, concurrency: int,
                  seed: int = 0) -> Workload:
    """`requests` user turns spread evenly over `systems` system prompts, in one shuffled order."""
    rng = random.Random(seed)
    system = [[rng.randrange(3, VOCAB) for _ in range(system_len)] for _ in range(systems)]
    which = [i % systems for i in range(requests)]
    rng.shuffle(which)
    prompts = [system[s] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(32, 96))] for s in which]
    return Workload(prompts, which, max_tokens, concurrency)


@dataclass
class Run:
    policy: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    routing: dict[str, float] = field(default_factory=dict)


class Served:
    """`lockstep serve --dp 2 --tp 1 --routing POLICY` on a free port, until closed."""

    def __init__(self, model: Path, policy: str, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.command = [sys.executable, "-m", "lockstep.cli", "serve", "--model", str(model), "--dp", "2",
                        "--tp", "1", "--port", str(self.port), "--kv-pages", str(args.kv_pages), "--threads",
                        str(args.threads), "--routing", policy, "--max-num-batched-tokens", str(args.batched_tokens)]
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        self.log_path = log
        deadline = time.monotonic() + 300
        while not self._both_up():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"lockstep serve did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _both_up(self) -> bool:
        try:
            status, detail = self.request("GET", "/health", timeout=2)
        except OSError:
            return False
        return status == 200 and isinstance(detail, dict) and all(g.get("up") for g in detail.values()) \
            and len(detail) == 2

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, object]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text

    def routing(self) -> dict[str, float]:
        _, text = self.request("GET", "/metrics")
        out: dict[str, float] = {}
        for reason, value in re.findall(r'lockstep_routing_decisions_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', text):
            out[reason] = out.get(reason, 0.0) + float(value)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def stream_one(port: int, prompt: list[int], max_tokens: int, run: Run, lock: threading.Lock) -> None:
    """One streamed completion: the time to its first token, and its usage (with the cached prompt tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0, first, usage = time.perf_counter(), None, None
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    except (OSError, RuntimeError, ValueError) as exc:
        with lock:
            run.errors.append(f"{type(exc).__name__}: {exc}")
        return
    finally:
        conn.close()
    with lock:
        if first is not None:
            run.ttft_s.append(first)
        if usage:
            run.prompt_tokens += usage["prompt_tokens"]
            run.output_tokens += usage["completion_tokens"]
            run.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def run_policy(model: Path, policy: str, workload: Workload, args: argparse.Namespace, log_dir: Path) -> Run:
    """A fresh `serve --dp 2` for the policy; a short warm-up unrelated to the workload; then the workload."""
    served = Served(model, policy, args, log_dir / f"serve-{policy}.log")
    run, lock = Run(policy), threading.Lock()
    try:
        warm = Run("warm-up")
        for i in range(4):  # reversed token ids: they share no page with the workload
            stream_one(served.port, list(reversed(workload.prompts[i][-40:])), 2, warm, lock)
        before = served.routing()
        todo = iter(range(len(workload.prompts)))

        def client() -> None:
            while (i := next(todo, None)) is not None:
                stream_one(served.port, workload.prompts[i], workload.max_tokens, run, lock)

        threads = [threading.Thread(target=client) for _ in range(workload.concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        run.wall_s = time.perf_counter() - t0
        run.routing = {k: v - before.get(k, 0.0) for k, v in served.routing().items() if v - before.get(k, 0.0)}
    finally:
        served.close()
    return run


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(runs: list[Run]) -> str:
    rows = [
        ("requests ok / errors", lambda r: f"{len(r.ttft_s)} / {len(r.errors)}"),
        ("cache hit tokens / prompt tokens", lambda r: f"{r.cached_tokens}/{r.prompt_tokens} = "
                                                       f"{r.cached_tokens / max(1, r.prompt_tokens):.1%}"),
        ("TTFT mean (ms)", lambda r: f"{1000 * statistics.fmean(r.ttft_s):.0f}" if r.ttft_s else "-"),
        ("TTFT p50 / p90 (ms)", lambda r: f"{1000 * _pct(r.ttft_s, 0.5):.0f} / {1000 * _pct(r.ttft_s, 0.9):.0f}"),
        ("output tokens/s", lambda r: f"{r.output_tokens / r.wall_s:.1f}"),
        ("requests/s", lambda r: f"{len(r.ttft_s) / r.wall_s:.2f}"),
        ("wall (s)", lambda r: f"{r.wall_s:.1f}"),
        ("routing decisions", lambda r: " ".join(f"{k}={v:.0f}" for k, v in sorted(r.routing.items()))),
    ]
    width = max(len(name) for name, _ in rows)
    cells = [[fmt(r) for r in runs] for _, fmt in rows]
    col = max(14, *(len(c) for row in cells for c in row))
    lines = [f"{'':<{width}}  " + "  ".join(f"{r.policy:>{col}}" for r in runs)]
    lines += [f"{name:<{width}}  " + "  ".join(f"{c:>{col}}" for c in row)
              for (name, _), row in zip(rows, cells, strict=True)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per system prompt")
    p.add_argument("--requests", type=int, default=192, help="user turns in all (spread evenly over the prompts)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="streaming clients")
    p.add_argument("--kv-pages", type=int, default=0,
                   help="KV pages per rank (default: 3/4 of all system prompts' pages, plus room to run)")
    p.add_argument("--batched-tokens", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "lockstep-bench-routing")
    args = p.parse_args(argv)
    if not args.kv_pages:
        args.kv_pages = (3 * args.prompts * args.prompt_len) // (4 * 16) + args.concurrency * 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_routing.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    model = build_model(args.model_dir / f"h{args.hidden}-l{args.layers}", args.hidden, args.layers)
    workload = make_workload(args.prompts, args.prompt_len, args.requests, args.max_tokens, args.concurrency)
    log_dir = Path(tempfile.mkdtemp(prefix="lockstep-bench-routing-"))
    print(f"$ {command.strip()}\n{args.prompts} system prompts x {args.prompt_len} tokens, {args.requests} "
          f"user turns of 32-96 tokens, {args.max_tokens} output tokens, {args.concurrency} streaming clients; "
          f"serve --dp 2 --tp 1, {args.kv_pages} KV pages per rank, Llama hidden {args.hidden} x {args.layers} "
          f"layers, {args.threads} thread(s) per rank; logs in {log_dir}", flush=True)
    runs = []
    for policy in args.policies:
        runs.append(run_policy(model, policy, workload, args, log_dir))
        print(f"  {policy}: {runs[-1].wall_s:.1f} s", flush=True)
    print(table(runs))
    for r in runs:
        for e in r.errors[:5]:
            print(f"{r.policy}: {e}", file=sys.stderr)
    return 1 if any(r.errors for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
