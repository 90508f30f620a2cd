"""What a newcomer feels: `lockstep serve` at each --tp (and collective transport), the README's first curl.

For each setting it starts `lockstep serve --model M --tp N` (LOCKSTEP_COMM=shm|gloo), waits until it serves,
sends one warm-up request, then times the README's first request (a 16-token greedy completion of "The
capital of France is", wall clock from the client) and one streamed 32-token completion (the median gap
between its tokens: the inter-token latency at batch 1). One line per setting, medians of --runs.

    LOCKSTEP_CACHE_DIR=/tmp/lockstep-test-builtin/cache python scripts/bench_first_request.py --tp 1 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lockstep.local_group import free_port

FIRST = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


def _post(url: str, body: dict, stream: bool = False) -> tuple[float, list[float]]:
    """(seconds for the whole answer, arrival times of the streamed chunks)."""
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({**body, "stream": stream}).encode())
    t0 = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return time.perf_counter() - t0, times


def measure(model: str, tp: int, comm: str, runs: int, log: Path) -> dict:
    port = free_port()
    env = {**os.environ, "LOCKSTEP_COMM": comm}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "serve", "--model", model, "--tp", str(tp),
                                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lockstep serve exited:\n{log.read_text()[-2000:]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        ready_s = time.perf_counter() - started
        _post(url, FIRST)
        firsts, gaps = [], []
        for _ in range(runs):
            firsts.append(_post(url, FIRST)[0])
            _, times = _post(url, {**FIRST, "max_tokens": 32, "ignore_eos": True}, stream=True)
            gaps.append(statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False)))
        return {"tp": tp, "comm": comm, "ready_s": ready_s, "first_curl_s": statistics.median(firsts),
                "itl_ms": 1e3 * statistics.median(gaps)}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--comm", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="lockstep-first-"))
    rows = []
    for tp in args.tp:
        for comm in (args.comm if tp > 1 else args.comm[:1]):
            rows.append(measure(args.model, tp, comm, args.runs, logs / f"serve-tp{tp}-{comm}.log"))
            r = rows[-1]
            print(f"tp {r['tp']}  {r['comm'] if tp > 1 else '-':<5} ready {r['ready_s']:6.1f} s   first curl "
                  f"(16 tokens) {r['first_curl_s']:6.2f} s   inter-token {r['itl_ms']:7.1f} ms", flush=True)
    base = next((r for r in rows if r["tp"] == 1), None)
    if base:
        for r in rows:
            if r["tp"] > 1:
                print(f"tp {r['tp']} {r['comm']}: inter-token {r['itl_ms'] / base['itl_ms']:.2f}x tp 1, first curl "
                      f"{r['first_curl_s'] / base['first_curl_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
