"""The served run: `lockstep rank` processes and `lockstep coordinator` on free local ports, loaded over HTTP."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lockstep.bench.report import RunResult
from lockstep.bench.workload import BenchConfig, Workload, sampling_of, warmup_prompts
from lockstep.local_group import free_port
from lockstep.local_ranks import rank_command, stop_processes

GROUP = "g0"


class ServedGroup:
    """`tp` rank processes and their coordinator, supervised for the length of one run."""

    def __init__(self, model_dir: Path, cfg: BenchConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        threads = max(1, (os.cpu_count() or 1) // cfg.tp)  # what LocalGroup gives each rank
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        rendezvous = f"127.0.0.1:{free_port()}"
        ports = [free_port() for _ in range(cfg.tp)]
        try:
            for r in range(cfg.tp):
                self._spawn(f"rank{r}", rank_command(r, cfg.tp, rendezvous, ports[r], model_dir, cfg.page_size,
                                                     cfg.kv_pages, threads, cfg.prefix_caching, cfg.dtype), env)
            self.port = free_port()
            coordinator = [
                sys.executable, "-m", "lockstep.cli", "coordinator", "--model", str(model_dir),
                "--group", f"{GROUP}=" + ",".join(f"127.0.0.1:{p}" for p in ports), "--host", "127.0.0.1",
                "--http-port", str(self.port), "--grpc-port", str(free_port()), "--page-size", str(cfg.page_size),
                "--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--max-num-seqs", str(cfg.max_num_seqs)]
            if not cfg.prefix_caching:
                coordinator.append("--no-prefix-caching")
            if cfg.api_workers:
                coordinator += ["--api-workers", str(cfg.api_workers)]
            self._spawn("coordinator", coordinator, env)
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _log_tail(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.is_file() else ""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {p.returncode} while starting:\n"
                                       f"{self._log_tail(name)}")
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the served group was not healthy after {self.cfg.startup_timeout_s:.0f} s:\n"
                           f"{self._log_tail('coordinator')}")

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 600.0,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, dict | str]:
        own = conn is None
        conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
        finally:
            if own:
                conn.close()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text

    def step_log(self, since: int = 0) -> tuple[list[list[float]], int]:
        """The coordinator's step timings from step `since` of this run on, and the index after them."""
        status, body = self.request("GET", f"/admin/steps?group={GROUP}&since={since}")
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"GET /admin/steps answered {status}: {body!r:.300}")
        if body["next"] < since:
            raise RuntimeError(f"the step log went back from {since} to {body['next']} steps: the group "
                               f"restarted during the run (see the logs in {self.log_dir})")
        if body["next"] - since > len(body["steps"]):
            raise RuntimeError(f"the run took more steps than the coordinator's step log keeps "
                               f"({len(body['steps'])} of {body['next'] - since}); run fewer requests")
        return body["steps"], body["next"]

    def close(self) -> None:
        stop_processes(list(reversed(self.procs.values())), grace_s=15)  # the coordinator first
        self.procs = {}

    def __enter__(self) -> ServedGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _completion(workload: Workload, i: int, prompt: tuple[int, ...] | None = None) -> dict:
    """Request i of the workload (or a warm-up prompt in its place), as the in-process run samples it."""
    return {"prompt": list(workload.prompts[i] if prompt is None else prompt), "max_tokens": workload.max_tokens,
            "ignore_eos": True, "return_token_ids": True, **sampling_of(workload, i)}


def _warm_up(group: ServedGroup, workload: Workload, n: int) -> None:
    warm = [threading.Thread(target=group.request, args=("POST", "/v1/completions",
                                                         _completion(workload, 0, p)))
            for p in warmup_prompts(workload, n)]
    for t in warm:
        t.start()
    for t in warm:
        t.join()


def _client(group: ServedGroup, workload: Workload, todo, lock: threading.Lock, result: RunResult,
            start: float) -> None:
    """One client with its own keep-alive connection: send the next request when the last is answered (and it
    has arrived, with a request rate)."""
    conn = http.client.HTTPConnection("127.0.0.1", group.port, timeout=600)
    try:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            workload.wait_for(i, start)
            t0 = time.perf_counter()
            try:
                status, body = group.request("POST", "/v1/completions",
                                             _completion(workload, i), conn=conn)
            except OSError as exc:
                result.errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", group.port, timeout=600)
                continue
            result.latencies_s.append(time.perf_counter() - t0)
            if status == 200 and isinstance(body, dict):
                result.outputs[i] = body["choices"][0].get("token_ids")
            else:
                result.errors.append(f"request {i}: HTTP {status}: {body!r:.300}")
    finally:
        conn.close()


def run_served(model_dir: Path, workload: Workload, cfg: BenchConfig, log_dir: Path) -> RunResult:
    """`concurrency` client threads, each with its own keep-alive connection, send the workload over HTTP."""
    result = RunResult("served", outputs=[None] * len(workload.prompts))
    with ServedGroup(model_dir, cfg, log_dir) as group:
        _warm_up(group, workload, cfg.warmup)
        _, since = group.step_log()
        todo = iter(range(len(workload.prompts)))
        lock = threading.Lock()
        t_start = time.perf_counter()
        clients = [threading.Thread(target=_client, args=(group, workload, todo, lock, result, t_start))
                   for _ in range(min(workload.concurrency, len(workload.prompts)))]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        result.wall_s = time.perf_counter() - t_start
        steps, _ = group.step_log(since)
        for batch, plan_s, send_s, wait_s, apply_s, engine_s, ahead_s, deliver_s in steps:
            result.batch.append(int(batch))
            result.step_s.append(plan_s + send_s + wait_s + apply_s + ahead_s + deliver_s)
            result.coordinator_s.append(plan_s + send_s + apply_s)  # exposed: a plan built ahead is hidden
            result.engine_s.append(engine_s)
            for name, value in (("plan", plan_s), ("send", send_s), ("wait", wait_s), ("apply", apply_s),
                                ("ahead", ahead_s), ("deliver", deliver_s)):
                result.parts_s.setdefault(name, []).append(value)
    return result
