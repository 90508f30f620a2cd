"""`lockstep bench`: the served group against the in-process engine, on one model and one workload.

Two runs with the same prompts, output length, concurrency and TP size:

- served: `lockstep rank` processes and a coordinator, driven through `POST /v1/completions` by
  `concurrency` client threads, each sending its next request when its last one is answered;
- in-process: the same pure Scheduler driving a LocalGroup of the same ranks directly
  (plan -> step -> apply, no gRPC, no HTTP, no asyncio), with the same concurrency limit. This is
  the limit without the control plane, so the ratio of the two throughputs is what the control
  plane costs.

Per step both record the step's wall time, the slowest rank's engine time, and the coordinator's own
time: plan + apply in-process; plan + serialize/send + apply in the served run, read from the step
log `GroupRunner._loop` keeps (the agreement wait excluded). The served coordinator is `lockstep
coordinator` itself, run with one extra read-only route, GET /bench/steps, that returns that log.

    lockstep bench --tiny --requests 64 --concurrency 16 --max-tokens 32 --json bench.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lockstep.local_group import free_port

SERVE_COORDINATOR = "--serve-coordinator"
STEP_LOG_LIMIT = 1 << 16  # the step log's maxlen in GroupRunner._loop
TARGET_RATIO = 0.85
TARGET_COORDINATOR_P50_S = 0.001


@dataclass(frozen=True)
class BenchConfig:
    """What both runs share besides the workload."""

    tp: int = 2
    page_size: int = 16
    kv_pages: int = 512
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    prefix_caching: bool = True
    warmup: int = 2
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    concurrency: int


@dataclass
class RunResult:
    """Raw measurements of one run; `summarize` turns them into the reported numbers."""

    name: str
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    outputs: list[list[int] | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # per step: chunks in the batch, wall, coordinator's own time, engine (slowest rank), and parts
    batch: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    coordinator_s: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    parts_s: dict[str, list[float]] = field(default_factory=dict)


def make_workload(requests: int, min_prompt: int, max_prompt: int, max_tokens: int, concurrency: int,
                  vocab: int, seed: int = 0) -> Workload:
    """Random token prompts of mixed lengths; ids start at 3 to stay clear of the usual special tokens."""
    if vocab <= 3:
        raise ValueError(f"the tokenizer has {vocab} ids; the benchmark needs more than 3")
    rng = random.Random(seed)
    prompts = tuple(
        tuple(rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))) for _ in range(requests)
    )
    return Workload(prompts, max_tokens, concurrency)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ----- the in-process limit


def run_in_process(model_dir: Path, workload: Workload, cfg: BenchConfig) -> RunResult:
    """Drive the pure Scheduler and a LocalGroup directly, keeping at most `concurrency` requests live."""
    from lockstep.coordinator.request import Request
    from lockstep.coordinator.scheduler import FINISHED, Scheduler
    from lockstep.kv.page_keys import key_salt
    from lockstep.local_group import LocalGroup

    result = RunResult("in-process", outputs=[None] * len(workload.prompts))
    with LocalGroup(str(model_dir), cfg.tp, page_size=cfg.page_size, kv_pages=cfg.kv_pages,
                    prefix_caching=cfg.prefix_caching, timeout_s=cfg.startup_timeout_s) as group:
        info = group.infos[0]
        scheduler = Scheduler(cfg.page_size, key_salt(info["model_id"], cfg.page_size), cfg.max_num_batched_tokens,
                              cfg.max_num_seqs, cfg.tp, cfg.prefix_caching, info["max_model_len"])
        state = {"step": 0, "reports": []}

        def drive(on_finish) -> None:
            while scheduler.has_work():
                t0 = time.perf_counter()
                plan = scheduler.plan(state["step"], state["reports"])
                t1 = time.perf_counter()
                reports = group.step(plan)
                t2 = time.perf_counter()
                events = scheduler.apply(reports)
                t3 = time.perf_counter()
                state["reports"] = reports
                state["step"] += 1
                if on_finish is not None:
                    result.batch.append(len(plan.batch))
                    result.step_s.append(t3 - t0)
                    result.coordinator_s.append((t1 - t0) + (t3 - t2))
                    result.engine_s.append(max(r.timings.get("step_s", 0.0) for r in reports))
                    result.parts_s.setdefault("plan", []).append(t1 - t0)
                    result.parts_s.setdefault("apply", []).append(t3 - t2)
                    for ev in events:
                        if ev.kind == FINISHED:
                            on_finish(ev)

        for i, prompt in enumerate(_warmup_prompts(workload, cfg.warmup)):
            scheduler.add(Request(f"warmup-{i}", prompt, max_tokens=workload.max_tokens))
        drive(None)

        pending = deque(enumerate(workload.prompts))
        live: dict[str, tuple[int, Request, float]] = {}

        def submit() -> None:
            while pending and len(live) < workload.concurrency:
                i, prompt = pending.popleft()
                req = Request(f"bench-{i}", prompt, max_tokens=workload.max_tokens)
                scheduler.add(req)
                live[req.request_id] = (i, req, time.perf_counter())

        def on_finish(ev) -> None:
            i, req, started = live.pop(ev.request_id)
            result.latencies_s.append(time.perf_counter() - started)
            if ev.finish_reason in ("length", "stop"):
                result.outputs[i] = list(req.generated)
            else:
                result.errors.append(f"request {i}: {ev.finish_reason} {ev.error}")
            submit()

        t_start = time.perf_counter()
        submit()
        drive(on_finish)
        result.wall_s = time.perf_counter() - t_start
    return result


def _warmup_prompts(workload: Workload, n: int) -> list[tuple[int, ...]]:
    """Short prompts unrelated to the measured ones (reversed tokens), so they warm nothing in the cache."""
    return [tuple(reversed(workload.prompts[i % len(workload.prompts)][:16])) for i in range(n)]


# ----- the served group


class ServedGroup:
    """`tp` `lockstep rank` processes and the coordinator (with its step log exposed) on free local ports."""

    def __init__(self, model_dir: Path, cfg: BenchConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        threads = max(1, (os.cpu_count() or 1) // cfg.tp)  # what LocalGroup gives each rank
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        rendezvous = f"127.0.0.1:{free_port()}"
        ports = [free_port() for _ in range(cfg.tp)]
        common = ["--model", str(model_dir), "--page-size", str(cfg.page_size)]
        if not cfg.prefix_caching:
            common.append("--no-prefix-caching")
        try:
            for r in range(cfg.tp):
                self._spawn(f"rank{r}", [sys.executable, "-m", "lockstep.cli", "rank", "--rank", str(r),
                                         "--world-size", str(cfg.tp), "--rendezvous", rendezvous, "--host",
                                         "127.0.0.1", "--port", str(ports[r]), "--kv-pages", str(cfg.kv_pages),
                                         "--threads", str(threads), *common], env)
            self.port = free_port()
            self._spawn("coordinator", [
                sys.executable, "-m", "lockstep.bench", SERVE_COORDINATOR,
                "--group", "g0=" + ",".join(f"127.0.0.1:{p}" for p in ports), "--host", "127.0.0.1",
                "--http-port", str(self.port), "--grpc-port", str(free_port()),
                "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                "--max-num-seqs", str(cfg.max_num_seqs), *common], env)
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

    def step_log(self, since: int = 0) -> list[list[float]]:
        status, body = self.request("GET", f"/bench/steps?since={since}")
        if status != 200 or not isinstance(body, dict):
            raise RuntimeError(f"GET /bench/steps answered {status}: {body!r:.300}")
        if body["total"] < since:
            raise RuntimeError(f"the step log went back from {since} to {body['total']} steps: the group "
                               f"restarted during the run (see the logs in {self.log_dir})")
        if body["total"] >= STEP_LOG_LIMIT:
            raise RuntimeError(f"the run took {body['total']} steps, more than the step log keeps "
                               f"({STEP_LOG_LIMIT}); run fewer requests")
        return body["steps"]

    def close(self) -> None:
        procs = list(reversed(self.procs.values()))  # the coordinator first
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = {}

    def __enter__(self) -> ServedGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _completion(prompt: tuple[int, ...], max_tokens: int) -> dict:
    return {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def run_served(model_dir: Path, workload: Workload, cfg: BenchConfig, log_dir: Path) -> RunResult:
    """`concurrency` client threads, each with its own keep-alive connection, send the workload over HTTP."""
    result = RunResult("served", outputs=[None] * len(workload.prompts))
    with ServedGroup(model_dir, cfg, log_dir) as group:
        warm = [threading.Thread(target=group.request, args=("POST", "/v1/completions",
                                                             _completion(p, workload.max_tokens)))
                for p in _warmup_prompts(workload, cfg.warmup)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        since = len(group.step_log())
        todo = iter(range(len(workload.prompts)))
        lock = threading.Lock()

        def client() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", group.port, timeout=600)
            try:
                while True:
                    with lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    t0 = time.perf_counter()
                    try:
                        status, body = group.request("POST", "/v1/completions",
                                                     _completion(workload.prompts[i], workload.max_tokens),
                                                     conn=conn)
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

        clients = [threading.Thread(target=client) for _ in range(min(workload.concurrency, len(workload.prompts)))]
        t_start = time.perf_counter()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        result.wall_s = time.perf_counter() - t_start
        for batch, plan_s, send_s, wait_s, apply_s, engine_s in group.step_log(since):
            result.batch.append(int(batch))
            result.step_s.append(plan_s + send_s + wait_s + apply_s)
            result.coordinator_s.append(plan_s + send_s + apply_s)
            result.engine_s.append(engine_s)
            for name, value in (("plan", plan_s), ("send", send_s), ("wait", wait_s), ("apply", apply_s)):
                result.parts_s.setdefault(name, []).append(value)
    return result


def _serve_coordinator(argv: list[str]) -> int:
    """`lockstep coordinator` as it is, plus GET /bench/steps?since=N: the group's step log from step N."""
    from aiohttp import web

    from lockstep.coordinator import main as coordinator_main
    from lockstep.coordinator.openai_api import OpenAIServer

    class StepLogServer(OpenAIServer):
        def app(self) -> web.Application:
            app = super().app()
            app.router.add_get("/bench/steps", self.steps)
            return app

        async def steps(self, request: web.Request) -> web.Response:
            since = int(request.query.get("since", "0"))
            groups = list(self.frontend.groups.values())
            log = list(getattr(groups[0], "step_timings", ())) if groups else []
            return web.json_response({"total": len(log), "steps": log[since:]})

    coordinator_main.OpenAIServer = StepLogServer
    return coordinator_main.main(argv)


# ----- the tiny model


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random Llama (hidden 64, 4 heads / 2 KV heads, 2 layers, vocab 384) with a word-level tokenizer.

    Weights are drawn wider than transformers' default init so greedy decoding has no near-ties and the
    served and in-process runs can be compared token for token.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    vocab = 384
    path.mkdir(parents=True, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "model_max_length": 512}))
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "embed_tokens" in name else 0.15
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path


# ----- numbers


def summarize(result: RunResult, workload: Workload) -> dict:
    """Throughput, step and coordinator times (p50/p99; also at full batch), completion counts."""
    want = workload.max_tokens
    complete = sum(1 for out in result.outputs if out is not None and len(out) == want)
    tokens = sum(len(out) for out in result.outputs if out is not None)
    ms = 1000.0

    def pct(values: list[float]) -> dict:
        return {"p50_ms": percentile(values, 50) * ms, "p99_ms": percentile(values, 99) * ms} if values else {}

    full = [c for b, c in zip(result.batch, result.coordinator_s, strict=True) if b == workload.concurrency]
    return {
        "name": result.name,
        "requests": len(result.outputs),
        "completed": complete,
        "errors": result.errors[:10],
        "output_tokens": tokens,
        "wall_s": result.wall_s,
        "throughput_tok_s": tokens / result.wall_s if result.wall_s > 0 else 0.0,
        "requests_s": complete / result.wall_s if result.wall_s > 0 else 0.0,
        "latency": pct(result.latencies_s),
        "steps": len(result.step_s),
        "step": pct(result.step_s),
        "engine": pct(result.engine_s),
        "coordinator": pct(result.coordinator_s),
        "coordinator_full_batch": {**pct(full), "steps": len(full), "batch": workload.concurrency},
        "parts": {name: pct(values) for name, values in result.parts_s.items()},
    }


def compare(served: dict, local: dict, served_out: RunResult, local_out: RunResult) -> dict:
    ratio = served["throughput_tok_s"] / local["throughput_tok_s"] if local["throughput_tok_s"] else 0.0
    same = sum(1 for a, b in zip(served_out.outputs, local_out.outputs, strict=True) if a is not None and a == b)
    coord = served["coordinator_full_batch"].get("p50_ms")
    return {
        "throughput_ratio": ratio,
        "ratio_target": TARGET_RATIO,
        "ratio_met": ratio >= TARGET_RATIO,
        "coordinator_p50_ms_at_full_batch": coord,
        "coordinator_target_ms": TARGET_COORDINATOR_P50_S * 1000,
        "coordinator_met": coord is not None and coord <= TARGET_COORDINATOR_P50_S * 1000,
        "identical_outputs": same,
    }


def format_table(report: dict) -> str:
    runs = report["runs"]
    w = report["workload"]
    lines = [
        f"lockstep bench: {w['requests']} requests, prompts {w['min_prompt']}-{w['max_prompt']} tokens, "
        f"{w['max_tokens']} output tokens, concurrency {w['concurrency']}, TP {report['config']['tp']}",
        f"{'':34}" + "".join(f"{r['name']:>14}" for r in runs),
    ]

    def row(label: str, get, fmt: str = "{:14.2f}") -> None:
        cells = []
        for r in runs:
            try:
                value = get(r)
            except KeyError:
                value = None
            cells.append(f"{'-':>14}" if value is None else fmt.format(value))
        lines.append(f"{label:34}" + "".join(cells))

    row("completed / requests", lambda r: f"{r['completed']}/{r['requests']}", "{:>14}")
    row("throughput (output tok/s)", lambda r: r["throughput_tok_s"], "{:14.1f}")
    row("wall (s)", lambda r: r["wall_s"])
    row("steps", lambda r: r["steps"], "{:14d}")
    for key, label in (("step", "step time"), ("engine", "engine / step (slowest rank)"),
                       ("coordinator", "coordinator time / step")):
        row(f"{label} p50 (ms)", lambda r, k=key: r[k]["p50_ms"], "{:14.3f}")
        row(f"{label} p99 (ms)", lambda r, k=key: r[k]["p99_ms"], "{:14.3f}")
    batch = w["concurrency"]
    row(f"coordinator @ batch {batch} p50 (ms)", lambda r: r["coordinator_full_batch"]["p50_ms"], "{:14.3f}")
    row(f"coordinator @ batch {batch} p99 (ms)", lambda r: r["coordinator_full_batch"]["p99_ms"], "{:14.3f}")
    for part in ("plan", "send", "apply", "wait"):
        row(f"  {part} p50 (ms)", lambda r, p=part: r["parts"][p]["p50_ms"], "{:14.3f}")
    row("request latency p50 (ms)", lambda r: r["latency"]["p50_ms"], "{:14.1f}")
    row("request latency p99 (ms)", lambda r: r["latency"]["p99_ms"], "{:14.1f}")
    c = report.get("comparison")
    if c:
        coord = c["coordinator_p50_ms_at_full_batch"]
        lines.append(f"served / in-process throughput: {c['throughput_ratio']:.3f} "
                     f"(target >= {c['ratio_target']}: {'met' if c['ratio_met'] else 'MISSED'})")
        lines.append(f"served coordinator p50 at batch {batch}: "
                     + ("no such steps" if coord is None else f"{coord:.3f} ms")
                     + f" (target <= {c['coordinator_target_ms']:g} ms: {'met' if c['coordinator_met'] else 'MISSED'})")
        lines.append(f"identical greedy outputs: {c['identical_outputs']}/{w['requests']}")
    return "\n".join(lines)


# ----- command line


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory")
    model.add_argument("--tiny", action="store_true", help="build a tiny random Llama into a temp dir "
                       "(needs transformers)")
    p.add_argument("--tp", type=_positive, default=2, help="tensor-parallel size of both runs")
    p.add_argument("--requests", type=_positive, default=64)
    p.add_argument("--concurrency", type=_positive, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=_positive, default=32, help="output tokens per request")
    p.add_argument("--min-prompt", type=_positive, default=16)
    p.add_argument("--max-prompt", type=_positive, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--page-size", type=_positive, default=16)
    p.add_argument("--kv-pages", type=_positive, default=512, help="KV pages per rank")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=512)
    p.add_argument("--max-num-seqs", type=_positive, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--warmup", type=_non_negative, default=2, help="requests run before measuring")
    p.add_argument("--only", choices=("served", "in-process"), help="run one side only")
    p.add_argument("--json", type=Path, help="also write the numbers to this file")
    p.add_argument("--log-dir", type=Path, help="keep the served processes' logs here")
    args = p.parse_args(argv)
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt {args.min_prompt} is larger than --max-prompt {args.max_prompt}")
    return args


def _model_limits(model_dir: Path) -> tuple[int, int]:
    """(token ids the prompts may use, positions) from the checkpoint's tokenizer and config."""
    from lockstep.tokenizer import Tokenizer

    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{model_dir} is not a checkpoint directory: it has no config.json")
    config = json.loads(config_file.read_text())
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        raise ValueError(f"{config_file} has no integer max_position_embeddings")
    vocab = min(Tokenizer.from_dir(model_dir).vocab_size, int(config.get("vocab_size", 1 << 31)))
    return vocab, positions


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == SERVE_COORDINATOR:
        return _serve_coordinator(argv[1:])
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    try:
        model_dir = build_tiny_model(scratch / "tiny") if args.tiny else args.model
        try:
            vocab, positions = _model_limits(model_dir)
        except ValueError as exc:
            print(f"lockstep bench: {exc}", file=sys.stderr)
            return 2
        if args.max_prompt + args.max_tokens > positions:
            print(f"lockstep bench: --max-prompt {args.max_prompt} + --max-tokens {args.max_tokens} exceed the "
                  f"model's {positions} positions", file=sys.stderr)
            return 2
        cfg = BenchConfig(tp=args.tp, page_size=args.page_size, kv_pages=args.kv_pages,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          prefix_caching=not args.no_prefix_caching, warmup=args.warmup)
        workload = make_workload(args.requests, args.min_prompt, args.max_prompt, args.max_tokens,
                                 args.concurrency, vocab, args.seed)
        log_dir = args.log_dir or scratch / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        raw: dict[str, RunResult] = {}
        if args.only in (None, "in-process"):
            raw["in-process"] = run_in_process(model_dir, workload, cfg)
        if args.only in (None, "served"):
            raw["served"] = run_served(model_dir, workload, cfg, log_dir)
        runs = [summarize(raw[name], workload) for name in ("served", "in-process") if name in raw]
        report = {
            "command": "lockstep bench " + " ".join(argv),
            "model": "tiny" if args.tiny else str(model_dir),
            "workload": {"requests": args.requests, "min_prompt": args.min_prompt, "max_prompt": args.max_prompt,
                         "max_tokens": args.max_tokens, "concurrency": args.concurrency, "seed": args.seed},
            "config": asdict(cfg),
            "cpus": os.cpu_count(),
            "runs": runs,
        }
        if len(raw) == 2:
            report["comparison"] = compare(runs[0], runs[1], raw["served"], raw["in-process"])
        print(format_table(report))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return 0 if all(r["completed"] == r["requests"] for r in runs) else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
