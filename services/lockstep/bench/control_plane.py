"""The control plane's ceiling: the real coordinator, gRPC streams and rank service around a forward that is free.

On a GPU a decode step takes a few milliseconds, so what the coordinator adds per step is what a GPU user pays
on top. This mode measures exactly that and nothing else:

- coordinator: the real `Coordinator` (its `GroupRunner` step loop, `Scheduler`, metrics and the dispatch of
  tokens to every request's queue, drained here by one task per request as the API handlers would), in this
  process, so `--profile` can cProfile it;
- ranks: `python -m lockstep.bench.control_plane_rank` processes, the real `lockstep rank` service (RankServer,
  RankServicer, StepGate, RankCache page bookkeeping, the agreement all-reduce over gloo at TP > 1) around
  `NoopForwardEngine`, whose forward returns a token per sampling chunk without running a model;
- the workload: `batch` requests at once, prompts of `min_prompt`..`max_prompt` random tokens, ending by
  `max_tokens` (no EOS is ever drawn); only steady decode steps are measured (every request got a token in
  the step and the one before, none finished), after `warmup` of them.

It is a benchmark mode, never a serving one: no flag of `lockstep serve`, `lockstep rank` or `lockstep
coordinator` reaches it. Per step it reports the coordinator's own step log (`GroupRunner.step_log`, as
`GET /admin/steps` serves it: plan, send = plan -> protobuf, agreement wait = the round trip, apply), the ranks'
`Timings` from their reports and their plan/report protobuf times (`control_plane_rank.WireTimes`).
`control_plane_report.py` turns that into the table; `scripts/bench_control_plane.py` is the command line.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import logging
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.coordinator.config import CoordinatorConfig
from lockstep.coordinator.events import Event, EventKind
from lockstep.coordinator.frontend_link import Link
from lockstep.coordinator.frontend_wire import events_from_proto
from lockstep.coordinator.generation import GenerateSpec
from lockstep.coordinator.group import GroupRunner, StepTiming
from lockstep.coordinator.service import Coordinator
from lockstep.kv.paging import pages_for
from lockstep.local_group import free_port
from lockstep.local_ranks import stop_processes
from lockstep.steps import Report, SamplingParams
from lockstep.tokenizer import Tokenizer

log = logging.getLogger("lockstep.bench.control_plane")

GROUP = "g0"
MODEL_ID = "noop-forward"  # control_plane_rank.MODEL_ID (not imported: that module loads torch, this one must not)
VOCAB = 32000
FIRST_TOKEN = 3
STARTUP_S = 180.0


@dataclass(frozen=True)
class ControlPlaneConfig:
    """One measured run: a batch of requests on one group of `tp` benchmark ranks."""

    batch: int
    tp: int = 1
    steps: int = 200  # steady decode steps measured
    warmup: int = 10  # steady decode steps run before measuring
    agreement: bool = True  # the ranks' agreement all-reduce (TP > 1); off: measured without it
    min_prompt: int = 16
    max_prompt: int = 64
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    overlap: bool = True  # plans built ahead of the last step's reports (the coordinator's default)
    frontends: bool = False  # the tokens go to an API frontend's link (--api-workers), not to in-process queues
    forward_ms: float = 0.0  # the ranks' forward takes this long (a sleep, as a host waits on its GPU); 0: no-op
    # with a forward that takes time: the ranks prepare step k + 1 while their "device" runs step k, as a CUDA rank
    # does (`Engine.runs_ahead`); off: the host waits for the forward where it begins, as on the CPU
    prepare_ahead: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.batch, self.tp, self.steps, self.min_prompt, self.page_size) < 1 or self.warmup < 0:
            raise ValueError(f"batch, tp, steps, prompts and page size must be >= 1, warmup >= 0: {self}")
        if self.min_prompt > self.max_prompt:
            raise ValueError(f"min_prompt {self.min_prompt} > max_prompt {self.max_prompt}")
        if not 0 <= self.forward_ms <= 10_000:  # NaN fails too
            raise ValueError(f"forward_ms must be in [0, 10000], got {self.forward_ms}")

    @property
    def step_budget(self) -> int:
        """The scheduler's tokens per step: at least a decode token for every request and as much prefill again."""
        return max(self.max_num_batched_tokens, 2 * self.batch)

    @property
    def max_tokens(self) -> int:
        """Enough output for the steady window to hold `warmup + steps` steps after every prefill ended."""
        prefill_steps = math.ceil(self.batch * self.max_prompt / (self.step_budget - self.batch))
        return self.warmup + self.steps + prefill_steps + 4

    @property
    def max_model_len(self) -> int:
        return self.max_prompt + self.max_tokens + self.page_size

    @property
    def kv_pages(self) -> int:
        """Every request's whole context on every rank, so nothing is ever preempted."""
        return self.batch * (pages_for(self.max_model_len, self.page_size) + 1) + 64


@dataclass
class RunRaw:
    """What one run recorded, joined with the ranks' own numbers once they exit (`rank_stats`)."""

    config: ControlPlaneConfig
    timings: list[StepTiming] = field(default_factory=list)
    reports: list[list[Report]] = field(default_factory=list)  # per step, every rank's report
    steady: list[bool] = field(default_factory=list)  # per step: a full decode step
    tokens: list[int] = field(default_factory=list)  # per request: tokens its client received
    finish_reasons: list[str] = field(default_factory=list)
    final_used_pages: list[int] = field(default_factory=list)  # per rank, by its last report
    wall_s: float = 0.0
    rank_stats: list[dict[str, Any]] = field(default_factory=list)
    link_s: dict[int, float] = field(default_factory=dict)  # per step: its frontend link message, built and encoded


class StepRecorder:
    """Sits in front of the coordinator's `on_events` (called once per step, in the step's apply): keeps each
    step's reports and events by reference only, so the apply time it adds is a list append and a look at each
    rank's error (a refused step ends the run at once: the scheduler would plan it again for ever)."""

    def __init__(self, runner: GroupRunner, batch: int, profiler: cProfile.Profile | None, warmup: int) -> None:
        self.runner = runner
        self.batch = batch
        self.profiler = profiler
        self.warmup = warmup
        self.steps: list[tuple[list[Report], list[Event]]] = []
        self.refused = asyncio.Event()  # a rank refused a step: the run is broken, not slow
        self.refusal = ""
        self._full_run = 0
        self._dispatch = runner.on_events
        runner.on_events = self._on_events

    def _on_events(self, group: str, events: list[Event]) -> None:
        reports = self.runner.last_reports
        self.steps.append((reports, events))
        if not self.refusal and any(r.error for r in reports):
            self.refusal = "; ".join(f"rank {r.rank}: {r.error}" for r in reports if r.error)
            self.refused.set()
        if self.profiler is not None:
            self._toggle_profiler(events)
        self._dispatch(group, events)

    def _toggle_profiler(self, events: list[Event]) -> None:
        """Profile only steady decode steps after the warmup (profiling a run slows it: never the table's run)."""
        full = is_full_decode(events, self.batch)
        self._full_run = self._full_run + 1 if full else 0
        if self._full_run == self.warmup + 2:
            self.profiler.enable()
        elif not full:
            self.profiler.disable()

    def steady(self) -> list[bool]:
        """Per step: a full decode step whose predecessor was one too (so every chunk was a single token)."""
        full = [is_full_decode(events, self.batch) for _, events in self.steps]
        return [f and i > 0 and full[i - 1] for i, f in enumerate(full)]


def is_full_decode(events: list[Event], batch: int) -> bool:
    """Every request of the batch got a token and none finished."""
    tokens = sum(1 for e in events if e.kind == EventKind.TOKEN)
    return tokens == batch and not any(e.kind != EventKind.TOKEN for e in events)


def _word_tokenizer() -> Tokenizer:
    """A tokenizer the coordinator holds but this mode never uses (requests come as token ids)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Tokenizer(Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), {}, None, set())


async def _drain(events: Any) -> tuple[int, str]:
    """One request's client: read every event off its queue, as an API handler would; (tokens, finish reason)."""
    tokens, reason = 0, ""
    async for ev in events:
        if ev.error:
            raise RuntimeError(f"a request failed: {ev.error}")
        if ev.token_id is not None:
            tokens += 1
        if ev.finish_reason is not None:
            reason = str(ev.finish_reason)
    return tokens, reason


class _Encoding(asyncio.Queue):
    """A link's queue that encodes each message as it is queued: what gRPC does with it on the same loop."""

    def put_nowait(self, item: Any) -> None:
        if item is not None:  # (message, its bytes); None ends a wedged link
            item[0].SerializeToString()
        super().put_nowait(item)


async def _linked_clients(coordinator: Coordinator, specs: dict[str, GenerateSpec], recorder: StepRecorder,
                          link_s: dict[int, float]) -> list[tuple[int, str]]:
    """The requests submitted through one frontend link, as `--api-workers` does: each step's tokens become one
    message, built and encoded on the coordinator's loop (timed, per step, into `link_s`), taken off the link as
    the frontend's stream takes it, and read (its columns counted per request) once the run is over: a frontend
    process reads them, not the coordinator's loop; (tokens, finish reason) per request."""
    link = Link(coordinator, "bench")
    link.out = _Encoding()
    flush = link._flush

    def timed_flush() -> None:
        t0 = time.perf_counter()
        flush()
        link_s[len(recorder.steps) - 1] = time.perf_counter() - t0

    link._flush = timed_flush  # type: ignore[method-assign]
    for rid, spec in specs.items():
        link.submit(rid, spec)
    taken = []
    while link.requests or not link.out.empty():
        item = await link.out.get()
        if item is None:
            raise RuntimeError(f"the link was closed: {link.wedged}")
        link.taken(item[1])
        taken.append(item[0])
    tokens, reasons = dict.fromkeys(specs, 0), dict.fromkeys(specs, "")
    for msg in taken:
        for rid, ev in events_from_proto(msg):  # as the frontend reads them
            if ev.error:
                raise RuntimeError(f"a request failed: {ev.error}")
            tokens[rid] += ev.token_id is not None
            reasons[rid] = str(ev.finish_reason) if ev.finish_reason is not None else reasons[rid]
    return [(tokens[rid], reasons[rid]) for rid in specs]


def prompts(cfg: ControlPlaneConfig) -> list[list[int]]:
    rng = random.Random(cfg.seed + cfg.batch)
    return [[rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(cfg.min_prompt, cfg.max_prompt))]
            for _ in range(cfg.batch)]


async def _until_done(clients: asyncio.Future, recorder: StepRecorder, timeout_s: float = 1800.0) -> list:
    """The clients' results; RuntimeError as soon as a rank refuses a step (the scheduler would retry it
    forever) or after `timeout_s`."""
    refused = asyncio.ensure_future(recorder.refused.wait())
    try:
        await asyncio.wait({clients, refused}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused.cancel()
    if not clients.done():
        clients.cancel()
        raise RuntimeError(f"the run did not finish: {recorder.refusal or f'still running after {timeout_s:.0f} s'}")
    return clients.result()


async def _released(runner: GroupRunner, timeout_s: float = 10.0) -> None:
    """Wait for the step that carries the last releases to be reported (pages still used after `timeout_s`
    stay in the run's `final_used_pages`, for the caller to see)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if runner.holds_nothing and all(p.used == 0 for r in runner.last_reports for p in r.pools):
            return
        await asyncio.sleep(0.005)


async def run_batch(addresses: list[str], cfg: ControlPlaneConfig, profiler: cProfile.Profile | None = None
                    ) -> RunRaw:
    """One coordinator, fresh, on already started ranks: `batch` requests at once, until all finished and their
    pages are released on every rank."""
    config = CoordinatorConfig(groups={GROUP: tuple(addresses)}, page_size=cfg.page_size,
                               max_num_batched_tokens=cfg.step_budget,
                               max_num_seqs=cfg.batch, prefix_caching=cfg.prefix_caching, overlap=cfg.overlap,
                               max_waiting_requests=max(1024, cfg.batch), dead_rank_timeout=60.0)
    coordinator = Coordinator(config, _word_tokenizer(), MODEL_ID, cfg.max_model_len)
    coordinator.start()
    runner = coordinator.groups[GROUP]
    recorder = StepRecorder(runner, cfg.batch, profiler, cfg.warmup)
    raw = RunRaw(cfg)
    try:
        await asyncio.wait_for(runner.ready.wait(), STARTUP_S)
        t0 = time.perf_counter()
        spec = [GenerateSpec(p, SamplingParams(), cfg.max_tokens) for p in prompts(cfg)]
        ids = [f"cp-{cfg.batch}-{i}" for i in range(len(spec))]
        if cfg.frontends:
            clients = asyncio.ensure_future(
                _linked_clients(coordinator, dict(zip(ids, spec, strict=True)), recorder, raw.link_s))
        else:
            clients = asyncio.gather(*(_drain(coordinator.generate(rid, s)) for rid, s in zip(ids, spec, strict=True)))
        done = await _until_done(clients, recorder)
        await _released(runner)
        raw.wall_s = time.perf_counter() - t0
        raw.tokens = [n for n, _ in done]
        raw.finish_reasons = [r for _, r in done]
        raw.timings, _ = runner.step_log(0)
        raw.reports = [reports for reports, _ in recorder.steps]
        raw.steady = recorder.steady()
        raw.final_used_pages = [sum(p.used for p in r.pools) for r in runner.last_reports]
    finally:
        if profiler is not None:
            profiler.disable()
        await coordinator.close()
    if len(raw.timings) != len(raw.reports):
        raise RuntimeError(f"{len(raw.timings)} steps in the step log, {len(raw.reports)} applied")
    return raw


class BenchRanks:
    """`tp` benchmark rank processes on free local ports, started once for several runs."""

    def __init__(self, tp: int, agreement: bool, kv_pages: int, max_model_len: int, page_size: int,
                 prefix_caching: bool, work_dir: Path, cpus: tuple[int, ...] = (), forward_ms: float = 0.0,
                 prepare_ahead: bool = True) -> None:
        self.tp = tp
        self.work_dir = work_dir
        ports = [free_port() for _ in range(tp)]
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        name = f"tp{tp}-{'agree' if agreement else 'noagree'}-fwd{forward_ms:g}{'' if prepare_ahead else '-sync'}"
        self.stats_paths = [work_dir / f"{name}-rank{r}.json" for r in range(tp)]
        rendezvous = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen] = []
        for r in range(tp):
            cmd = [sys.executable, "-m", "lockstep.bench.control_plane_rank", "--rank", str(r), "--world-size",
                   str(tp), "--rendezvous", rendezvous, "--port", str(ports[r]), "--page-size", str(page_size),
                   "--kv-pages", str(kv_pages), "--max-model-len", str(max_model_len), "--vocab-size", str(VOCAB),
                   "--stats", str(self.stats_paths[r]), "--forward-ms", repr(forward_ms)]
            cmd += [] if agreement else ["--no-agreement"]
            cmd += [] if prepare_ahead else ["--no-prepare-ahead"]
            cmd += [] if prefix_caching else ["--no-prefix-caching"]
            cmd += ["--cpu", str(cpus[r % len(cpus)])] if cpus else []
            with open(self.stats_paths[r].with_suffix(".log"), "wb") as out:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))

    def stop(self) -> list[dict[str, Any]]:
        """Stop the ranks (SIGTERM: they finish their step and write their stats) and read what they wrote."""
        stop_processes(self.procs, grace_s=20)
        stats = []
        for path in self.stats_paths:
            if not path.is_file():
                tail = path.with_suffix(".log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"a benchmark rank wrote no stats ({path}):\n{tail}")
            stats.append(json.loads(path.read_text()))
        return stats


async def run_configs(configs: list[ControlPlaneConfig], work_dir: Path, profile: bool = False,
                      rank_cpus: tuple[int, ...] = ()) -> tuple[list[RunRaw], cProfile.Profile | None]:
    """Every run, grouped by (TP, agreement) so one set of ranks serves all its batches; with `profile`, the
    coordinator is profiled during the steady steps of the first group's largest batch. With `rank_cpus`, rank r
    runs on core rank_cpus[r % len] (shared when there are more ranks than cores)."""
    groups: dict[tuple[int, bool, float, bool], list[ControlPlaneConfig]] = {}
    for cfg in configs:
        groups.setdefault((cfg.tp, cfg.agreement, cfg.forward_ms, cfg.prepare_ahead), []).append(cfg)
    runs: list[RunRaw] = []
    profiler = cProfile.Profile() if profile else None
    for (tp, agreement, forward_ms, prepare_ahead), cfgs in groups.items():
        big = max(cfgs, key=lambda c: c.kv_pages)
        ranks = BenchRanks(tp, agreement, big.kv_pages, max(c.max_model_len for c in cfgs), big.page_size,
                           big.prefix_caching, work_dir, rank_cpus, forward_ms, prepare_ahead)
        mine: list[RunRaw] = []
        try:
            for cfg in cfgs:
                use = profiler if cfg is big and profiler is not None and not runs else None
                log.info("control plane: TP %d, agreement %s, batch %d", tp, agreement, cfg.batch)
                mine.append(await run_batch(ranks.addresses, cfg, use))
        finally:
            stats = ranks.stop()
        for raw in mine:
            raw.rank_stats = stats
        runs.extend(mine)
    # a closed coordinator can leave a stream's pending inbox read behind (GroupRanks.idle); end it here
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()
    return runs, profiler


def run_all(configs: list[ControlPlaneConfig], work_dir: Path | None = None, profile: bool = False,
            rank_cpus: tuple[int, ...] = ()) -> tuple[list[RunRaw], cProfile.Profile | None]:
    """`run_configs` in a fresh event loop, in `work_dir` (a temporary directory unless given)."""
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(run_configs(configs, work_dir, profile, rank_cpus))
    with tempfile.TemporaryDirectory(prefix="lockstep-cp-") as tmp:
        return asyncio.run(run_configs(configs, Path(tmp), profile, rank_cpus))
