"""The control-plane benchmark's command line (`scripts/bench_control_plane.py`, `lockstep bench --control-plane`).

    python scripts/bench_control_plane.py --batch 8,64,256 --tp 1,2 --steps 200 [--agreement both] [--profile 25]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pstats
import sys
from pathlib import Path

from lockstep.bench.control_plane import ControlPlaneConfig, run_all
from lockstep.bench.control_plane import __doc__ as mode_doc
from lockstep.bench.control_plane_report import format_table, summarize


def _int_list(text: str) -> list[int]:
    """`8,64,256` -> [8, 64, 256]; every item a positive integer."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None, prog: str = "bench_control_plane.py") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=mode_doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=_int_list, default=[8, 64, 256], help="requests running at once, e.g. 8,64,256")
    p.add_argument("--tp", type=_int_list, default=[1, 2], help="ranks per group, e.g. 1,2")
    p.add_argument("--steps", type=int, default=200, help="steady decode steps measured per run")
    p.add_argument("--warmup", type=int, default=10, help="steady decode steps run before measuring")
    p.add_argument("--agreement", choices=("on", "off", "both"), default="on",
                   help="the ranks' agreement all-reduce at TP > 1 (both: a run with and one without)")
    p.add_argument("--overlap", choices=("on", "off", "both"), default="both",
                   help="overlap scheduling (the next plan built while the ranks run a step); both: a run each")
    p.add_argument("--frontends", choices=("on", "off", "both"), default="off",
                   help="tokens to an API frontend's link, one message per step (as --api-workers), instead of a "
                        "queue per request; both: a run each")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill's step budget")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--forward-ms", type=float, default=0.0,
                   help="the ranks' forward takes this long, as a GPU's would (the host sleeps, as it waits on the "
                        "device); 0: no-op. What the total adds to it is what the forward does not hide")
    p.add_argument("--prepare-ahead", choices=("on", "off", "both"), default="on",
                   help="with --forward-ms: the ranks prepare the next step while the forward runs, as a CUDA rank "
                        "does (off: the host waits for the forward where it begins, as on the CPU); both: a run each")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also cProfile the coordinator in an extra run (first TP, largest batch) and print its "
                        "top N functions by own time")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--work-dir", type=Path, help="keep the ranks' logs and stats here")
    p.add_argument("--split-cores", action="store_true",
                   help="the coordinator on the first core this process may use, the ranks on the others (as on a "
                        "GPU host, where they do not share cores); else all share every core")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.min_prompt < 1 or args.min_prompt > args.max_prompt:
        p.error("--steps must be >= 1, --warmup >= 0 and 1 <= --min-prompt <= --max-prompt")
    if not 0 <= args.forward_ms <= 10_000:  # NaN fails too
        p.error(f"--forward-ms must be in [0, 10000], got {args.forward_ms}")
    return args


def configs(args: argparse.Namespace) -> list[ControlPlaneConfig]:
    """One run per (TP, agreement, overlap, frontends, batch); TP 1 has no agreement to turn off."""
    modes = {"on": (True,), "off": (False,), "both": (True, False)}
    return [ControlPlaneConfig(batch=b, tp=tp, steps=args.steps, warmup=args.warmup, agreement=agree,
                               min_prompt=args.min_prompt, max_prompt=args.max_prompt, page_size=args.page_size,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               prefix_caching=not args.no_prefix_caching, overlap=overlap, frontends=fe,
                               forward_ms=args.forward_ms, prepare_ahead=ahead)
            for tp in args.tp for agree in (modes[args.agreement] if tp > 1 else (True,))
            for ahead in (modes[args.prepare_ahead] if args.forward_ms else (True,))
            for overlap in modes[args.overlap] for fe in modes[args.frontends] for b in args.batch]


def profile_text(args: argparse.Namespace, work_dir: Path | None) -> str:
    """The coordinator's top functions during the steady steps of the largest batch (an extra, slower run)."""
    cfg = max(configs(args)[: len(args.batch)], key=lambda c: c.batch)
    _, profiler = run_all([cfg], work_dir, profile=True)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"coordinator cProfile, TP {cfg.tp} batch {cfg.batch}, steady decode steps:\n")
    stats.sort_stats("tottime").print_stats(args.profile)
    stats.sort_stats("cumulative").print_stats(args.profile)
    return out.getvalue()


def split_cores() -> tuple[int, ...]:
    """Pin this process (the coordinator) to its first core; the cores left, for the ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split-cores needs at least two cores")
    os.sched_setaffinity(0, {cores[0]})
    return tuple(cores[1:])


def main(argv: list[str] | None = None, prog: str = "bench_control_plane.py") -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    runs, _ = run_all(configs(args), args.work_dir, rank_cpus=split_cores() if args.split_cores else ())
    rows = [summarize(raw) for raw in runs]
    print(format_table(rows))
    if args.profile:
        print()
        print(profile_text(args, args.work_dir))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    ok = all(r["completed"] == r["batch"] and not any(r["final_used_pages"]) and r["measured_steps"] for r in rows)
    return 0 if ok else 1
