"""The control-plane benchmark's numbers: per-step parts of the steady decode steps, and the table beside the anchors.

Per step (ms, p50 and p90 over the measured steps):

- plan: the coordinator's `Scheduler.plan` (and the step loop around it), from the step log;
- serialize: plan -> protobuf (`wire.plan_to_proto`) and queueing it for every rank's stream writer (the
  message's encoding to bytes happens in that writer, inside the round trip);
- round trip: from the plan queued to every rank's report back and decoded (the agreement wait);
- rank apply: the slowest rank's plan protobuf -> plan, its rank service's step (the StepGate and the engine:
  RankCache prepare, the agreement all-reduce, the no-op forward, RankCache advance and finish) and its report
  -> protobuf; `rank engine` is the engine's part of it alone, `rank wire` the two protobuf conversions (done
  beside the step thread: by the thread that reads the plan and the handler that sends the report);
- rank gap: the least time any rank's step thread spent between the step before and this one, outside its
  engine: waiting for this plan, and the rank service's own bookkeeping (a few microseconds). More than that
  and the ranks waited on the coordinator: the step's pace was the coordinator's, not theirs;
- transport: round trip minus rank apply: gRPC (with the plan's encoding and the reports' decoding,
  `wire.report_from_proto`), both processes' thread hand-offs and the event loop's wake-up (with overlap
  the ranks start a plan sent ahead before its round trip is timed, so this reads below zero there);
- apply: `Scheduler.apply` and the pool gauges;
- ahead: with overlap, building and serializing the next plan while the ranks run this one (the plan of the
  next step then reads 0 in plan and serialize);
- deliver: the step before's tokens dispatched to their requests' queues, once this step's plans are sent;
- total: plan + serialize + ahead + deliver + round trip + apply, the coordinator's
  `lockstep_step_duration_seconds`;
- link: with frontends (`--frontends`, as `--api-workers` runs), the step's message to the API frontend, built
  and encoded right after its tokens are delivered;
- coordinator: plan + serialize + ahead + deliver + apply + link, the coordinator's own time;
- exposed: the part of it while no plan was in flight on the ranks: plan + serialize, and apply unless the next
  plan was sent ahead (then the ranks run it meanwhile). Overlap hides coordinator - exposed.
"""

from __future__ import annotations

from typing import Any

from lockstep.bench.control_plane import RunRaw
from lockstep.bench.report import percentile

VLLM_UPDATE_FROM_OUTPUT_MS = 0.13  # vLLM's Scheduler.update_from_output at batch 128 (issue 11)
VLLM_BATCH = 128
TRTLLM_HOST_OVERHEAD_MS = 0.58  # TensorRT-LLM's host overhead per iteration (issue 11)
TARGET_TOTAL_MS = 1.0  # issue 11: the control plane's step at batch 256
TARGET_BATCH = 256
HEADERS = {"plan": "plan", "serialize": "serialize", "round_trip": "round trip", "rank_apply": "rank apply",
           "rank_engine": "rank engine", "rank_wire": "rank wire", "rank_gap": "rank gap", "transport": "transport",
           "apply": "apply", "ahead": "ahead", "deliver": "deliver", "link": "link", "total": "total",
           "coordinator": "coordinator", "exposed": "exposed"}
PARTS = tuple(HEADERS)


def _rank_apply(reports: list, stats: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Of one step, the slowest rank's: deserialize + service step + serialize, engine step, and protobuf time."""
    applies, engines, wires = [], [], []
    for report in reports:
        own = stats[report.rank]
        key = str(report.step)
        wire = own["plan_s"].get(key, 0.0) + own["report_s"].get(key, 0.0)
        applies.append(wire + report.timings.rank_step_s)
        engines.append(report.timings.step_s)
        wires.append(wire)
    return max(applies), max(engines), max(wires)


def _rank_gap(step: int, stats: list[dict[str, Any]]) -> float:
    """Of one step, the least time any rank's step thread spent between the engine's step before and this one."""
    key, before = str(step), str(step - 1)
    gaps = [own["step_began"][key] - own["step_ended"][before] for own in stats
            if key in own.get("step_began", {}) and before in own.get("step_ended", {})]
    return min(gaps, default=0.0)


def _prepared_ahead(raw: RunRaw) -> float:
    """The share of the measured steps that every rank prepared during the forward of the step before."""
    steady = [i for i, s in enumerate(raw.steady) if s][raw.config.warmup:raw.config.warmup + raw.config.steps]
    staged = [set(own.get("staged", ())) for own in raw.rank_stats]
    ahead = [i for i in steady if all(raw.reports[i][0].step in s for s in staged)]
    return len(ahead) / len(steady) if steady else 0.0


def step_parts(raw: RunRaw) -> dict[str, list[float]]:
    """Seconds of every part of each measured step: the steady decode steps after the warmup, at most `steps`."""
    steady = [i for i, s in enumerate(raw.steady) if s]
    chosen = steady[raw.config.warmup:raw.config.warmup + raw.config.steps]
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    for i in chosen:
        t = raw.timings[i]
        rank_apply, rank_engine, rank_wire = _rank_apply(raw.reports[i], raw.rank_stats)
        values = {"plan": t.plan_s, "serialize": t.send_s, "round_trip": t.wait_s, "rank_apply": rank_apply,
                  "rank_engine": rank_engine, "rank_wire": rank_wire,
                  "rank_gap": _rank_gap(raw.reports[i][0].step, raw.rank_stats), "transport": t.wait_s - rank_apply,
                  "apply": t.apply_s, "ahead": t.ahead_s, "deliver": t.deliver_s, "link": raw.link_s.get(i, 0.0),
                  "total": t.plan_s + t.send_s + t.ahead_s + t.deliver_s + t.wait_s + t.apply_s,
                  "coordinator": t.plan_s + t.send_s + t.ahead_s + t.deliver_s + t.apply_s + raw.link_s.get(i, 0.0),
                  "exposed": t.plan_s + t.send_s + (0.0 if t.ahead_s else t.apply_s)}
        for name, value in values.items():
            parts[name].append(value)
    return parts


def summarize(raw: RunRaw) -> dict[str, Any]:
    """One row of the table: the run's shape, its p50 and p90 per part (ms), and whether it ran as it should."""
    cfg = raw.config
    parts = step_parts(raw)
    return {
        "tp": cfg.tp, "agreement": cfg.agreement, "overlap": cfg.overlap, "frontends": cfg.frontends,
        "forward_ms": cfg.forward_ms, "prepare_ahead": cfg.prepare_ahead,
        "prepared_ahead": _prepared_ahead(raw),
        "batch": cfg.batch,
        "measured_steps": len(parts["total"]),
        "steps_run": len(raw.timings), "max_tokens": cfg.max_tokens, "wall_s": raw.wall_s,
        "completed": sum(1 for n, r in zip(raw.tokens, raw.finish_reasons, strict=True)
                         if n == cfg.max_tokens and r == "length"),
        "final_used_pages": raw.final_used_pages,
        "ms": {name: {"p50": percentile(v, 50) * 1e3, "p90": percentile(v, 90) * 1e3} if v else None
               for name, v in parts.items()},
    }


def _label(row: dict[str, Any]) -> str:
    agree = ("agree on" if row["agreement"] else "agree off") if row["tp"] > 1 else ""
    overlap = "overlap" if row.get("overlap", True) else "no overlap"
    overlap += " +fe" if row.get("frontends") else ""
    overlap += f" fwd {row['forward_ms']:g}" if row.get("forward_ms") else ""
    overlap += "" if row.get("prepare_ahead", True) else " sync"
    return f"TP {row['tp']} {agree:9} {overlap:14} batch {row['batch']:>4}"


def _name(row: dict[str, Any]) -> str:
    return " ".join(_label(row).split())


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as p50 and p90 ms per part, then the published anchors and the issue's target beside them."""
    head = f"{'':41}{'steps':>6}" + "".join(f"{HEADERS[p]:>12}" for p in PARTS)
    lines = ["control plane per decode step (no-op forward; real coordinator, gRPC streams, rank service)"]
    for stat in ("p50", "p90"):
        lines += ["", f"{stat}, ms", head, "-" * len(head)]
        for row in rows:
            cells = "".join(f"{'-':>12}" if row["ms"][p] is None else f"{row['ms'][p][stat]:12.3f}" for p in PARTS)
            lines.append(f"{_label(row):41}{row['measured_steps']:>6}" + cells)
    return "\n".join(lines + _anchors(rows))


def _anchors(rows: list[dict[str, Any]]) -> list[str]:
    """The published numbers the rows compare with, the issue's target, and any run that did not complete."""
    lines = ["", "anchors (published, other systems, other machines):",
              f"  vLLM Scheduler.update_from_output at batch {VLLM_BATCH}: {VLLM_UPDATE_FROM_OUTPUT_MS} ms"
              " (compare: apply)",
              f"  TensorRT-LLM host overhead per iteration: ~{TRTLLM_HOST_OVERHEAD_MS} ms (compare: total)"]
    for row in rows:
        if row["batch"] == VLLM_BATCH and row["ms"]["apply"]:
            lines.append(f"  here, {_name(row)}: apply p50 {row['ms']['apply']['p50']:.3f} ms")
    for row in rows:
        if row["batch"] == TARGET_BATCH and row["ms"]["total"]:
            total = row["ms"]["total"]["p50"]
            exposed, gap, forward = row["ms"]["exposed"]["p50"], row["ms"]["rank_gap"]["p50"], row.get("forward_ms")
            if forward:  # the target is what the control plane adds to a forward that takes this long
                total -= forward
            verdict = "met" if total <= TARGET_TOTAL_MS else "MISSED"
            lines.append(f"  target total <= {TARGET_TOTAL_MS:g} ms at batch {TARGET_BATCH}"
                         f"{f' beyond a {forward:g} ms forward' if forward else ''}, {_name(row)}:"
                         f" p50 {total:.3f} ms ({verdict}); exposed p50 {exposed:.3f} ms; the ranks spent p50"
                         f" {gap:.3f} ms between steps (waiting for the next plan)"
                         + (f"; {row['prepared_ahead']:.0%} of the steps prepared during the forward before"
                            if forward and row.get("prepare_ahead", True) else ""))
    bad = [r for r in rows if r["completed"] != r["batch"] or any(r["final_used_pages"])]
    for r in bad:
        lines.append(f"  WARNING {_name(r)}: {r['completed']}/{r['batch']} requests completed, "
                     f"pages still used {r['final_used_pages']}")
    return lines
