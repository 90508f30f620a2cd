"""The benchmark's numbers: raw measurements of a run, their summary, the comparison and the table."""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.bench.workload import Workload

TARGET_RATIO = 0.85
TARGET_COORDINATOR_P50_S = 0.001


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



def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)



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
        # steps whose next plan went out before their reports came (overlap); the in-process run has none
        "planned_ahead": (sum(1 for s in result.parts_s["ahead"] if s > 0) / len(result.parts_s["ahead"])
                          if result.parts_s.get("ahead") else None),
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
        f"{w['max_tokens']} output tokens, concurrency {w['concurrency']}, TP {report['config']['tp']}"
        + (f", {w['request_rate']:g} requests/s (Poisson)" if w.get("request_rate") else ""),
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
    row("steps planned ahead (%)", lambda r: None if r["planned_ahead"] is None else 100 * r["planned_ahead"],
        "{:14.1f}")
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
        lines.append(f"identical outputs: {c['identical_outputs']}/{w['requests']}")
    return "\n".join(lines)
