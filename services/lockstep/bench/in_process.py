"""The in-process limit: the pure Scheduler driving a LocalGroup directly, no gRPC, no HTTP, no asyncio."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from lockstep.bench.report import RunResult
from lockstep.bench.workload import BenchConfig, Workload, sampling_of, warmup_prompts


def run_in_process(model_dir: Path, workload: Workload, cfg: BenchConfig) -> RunResult:
    """Drive the pure Scheduler and a LocalGroup directly, keeping at most `concurrency` requests live."""
    from lockstep.coordinator.request import Request
    from lockstep.coordinator.scheduler import FINISHED, Scheduler
    from lockstep.kv.page_keys import key_salt
    from lockstep.local_group import LocalGroup
    from lockstep.steps import SamplingParams

    result = RunResult("in-process", outputs=[None] * len(workload.prompts))
    with LocalGroup(str(model_dir), cfg.tp, page_size=cfg.page_size, kv_pages=cfg.kv_pages,
                    prefix_caching=cfg.prefix_caching, timeout_s=cfg.startup_timeout_s, dtype=cfg.dtype) as group:
        info = group.infos[0]
        scheduler = Scheduler(cfg.page_size, key_salt(info.model_id, cfg.page_size), cfg.max_num_batched_tokens,
                              cfg.max_num_seqs, cfg.tp, cfg.prefix_caching, info.max_model_len,
                              window=info.sliding_window)
        state = {"step": 0, "reports": []}

        def drive(on_finish) -> None:
            while scheduler.has_work():
                if on_finish is not None:
                    submit()  # what arrived meanwhile (with a request rate)
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
                    result.engine_s.append(max(r.timings.step_s for r in reports))
                    result.parts_s.setdefault("plan", []).append(t1 - t0)
                    result.parts_s.setdefault("apply", []).append(t3 - t2)
                    for ev in events:
                        if ev.kind == FINISHED:
                            on_finish(ev)

        for i, prompt in enumerate(warmup_prompts(workload, cfg.warmup)):
            scheduler.add(Request(f"warmup-{i}", prompt, max_tokens=workload.max_tokens))
        drive(None)

        pending = deque(enumerate(workload.prompts))
        live: dict[str, tuple[int, Request, float]] = {}

        def submit() -> None:
            while pending and len(live) < workload.concurrency and workload.arrived(pending[0][0], t_start):
                i, prompt = pending.popleft()
                req = Request(f"bench-{i}", prompt, SamplingParams(**sampling_of(workload, i)), workload.max_tokens)
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
        while pending:  # idle until the next arrival (with a request rate)
            workload.wait_for(pending[0][0], t_start)
            submit()
            drive(on_finish)
        result.wall_s = time.perf_counter() - t_start
    return result
