"""`lockstep bench` on the command line: flags, the two runs, the table and the JSON report."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lockstep.bench import __doc__ as bench_doc
from lockstep.bench.in_process import run_in_process
from lockstep.bench.report import RunResult, compare, format_table, summarize
from lockstep.bench.served import run_served
from lockstep.bench.tiny_model import build_tiny_model
from lockstep.bench.workload import BenchConfig, make_workload
from lockstep.engine_config import DTYPE
from lockstep.settings import add_settings, resolve


def _int_at_least(low: int):
    """An argparse type: an integer >= low, refused with a message naming what was given."""
    words = "a positive integer" if low == 1 else f"an integer >= {low}"

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {words}, got {value}")
        return value

    return read


CONTROL_PLANE_EPILOG = """\
lockstep bench --control-plane [--batch 8,64,256] [--tp 1,2] [--steps N] [--agreement on|off|both] ...
  A different benchmark: the control plane's ceiling. The real coordinator, gRPC streams and rank service
  around a forward that runs no model, per step at each batch (`lockstep bench --control-plane --help`)."""


_positive = _int_at_least(1)


def _temperature(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 2:  # NaN too
        raise argparse.ArgumentTypeError(f"the temperature must be in [0, 2], got {text}")
    return value
_non_negative = _int_at_least(0)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"the request rate must be a number > 0 (or inf), got {text!r}")
    return value


# What only the two runs lockstep bench starts itself take; an error with --url, where it would do nothing.
_SERVED_ONLY = ("tp", "page_size", "kv_pages", "max_num_batched_tokens", "max_num_seqs", "no_prefix_caching",
                "api_workers", "dtype", "only", "log_dir")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep bench", description=bench_doc, epilog=CONTROL_PLANE_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a Hugging Face checkpoint directory, or 'builtin' / 'builtin:NAME' "
                       "(fetched and imported on first use, as `lockstep serve` does)")
    model.add_argument("--tiny", action="store_true", help="build a tiny random Llama into a temp dir "
                       "(needs transformers)")
    p.add_argument("--tp", type=_positive, default=0,
                   help="tensor-parallel size of both runs (default: as `lockstep serve` chooses it)")
    p.add_argument("--requests", type=_positive, default=64)
    p.add_argument("--concurrency", type=_positive, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=_positive, default=32, help="output tokens per request")
    p.add_argument("--min-prompt", type=_positive, default=16)
    p.add_argument("--max-prompt", type=_positive, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, arriving as a Poisson process (seeded by --seed; inf, the default: "
                        "all at once); --concurrency still caps how many are in flight")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature of every request (0: greedy; above, request i is seeded with i, so "
                        "both runs draw the same tokens)")
    p.add_argument("--page-size", type=_positive, default=16)
    p.add_argument("--kv-pages", type=_positive, default=512, help="KV pages per rank")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=512)
    p.add_argument("--max-num-seqs", type=_positive, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--api-workers", type=_non_negative, default=0,
                   help="the served run's coordinator serves HTTP from this many frontend processes (--api-workers)")
    add_settings(p, (DTYPE,))
    p.add_argument("--warmup", type=_non_negative, default=2, help="requests run before measuring")
    p.add_argument("--only", choices=("served", "in-process"), help="run one side only")
    p.add_argument("--json", type=Path, help="also write the numbers to this file")
    p.add_argument("--log-dir", type=Path, help="keep the served processes' logs here")
    p.add_argument("--url", action="append", default=[], metavar="URL",
                   help="instead of the two runs: load this OpenAI-compatible server (http://host:port/v1), "
                   "repeatable, each in turn with the same streamed text prompts (made from --model's tokenizer)")
    p.add_argument("--served-model", default="", help="with --url: the `model` field to send")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="with --url: Bearer key (default: $OPENAI_API_KEY)")
    args = p.parse_args(argv)
    if args.url:
        given = [f"--{name.replace('_', '-')}" for name in _SERVED_ONLY if getattr(args, name) != p.get_default(name)]
        if given:
            p.error(f"{', '.join(given)}: {'it sets' if len(given) == 1 else 'they set'} up the runs lockstep bench "
                    "starts; with --url the server is already running as it was started")
    args.dtype = resolve(p, args, (DTYPE,), os.environ)["dtype"]
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt {args.min_prompt} is larger than --max-prompt {args.max_prompt}")
    return args


def _model_dir(model: str) -> Path:
    """--model as a directory: 'builtin' and 'builtin:NAME' resolve to the cached import (fetched once)."""
    if model.startswith("builtin"):
        from lockstep.model.builtin import BuiltinModelUnavailable, resolve_model

        try:
            return resolve_model(model, progress=lambda line: print(line, file=sys.stderr))
        except BuiltinModelUnavailable as exc:
            raise ValueError(str(exc)) from None
    return Path(model)


def _model_limits(model_dir: Path) -> tuple[int, int]:
    """(token ids the prompts may use, positions) from the checkpoint's tokenizer and config."""
    from lockstep.model.config import ModelConfig
    from lockstep.tokenizer import Tokenizer

    try:
        config = ModelConfig.from_dir(model_dir)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    return min(Tokenizer.from_dir(model_dir).vocab_size, config.vocab_size), config.max_position_embeddings


def _prepared(args: argparse.Namespace, scratch: Path) -> tuple[Path, Any]:
    """The model's directory and the workload; a ValueError saying what is wrong with them."""
    model_dir = build_tiny_model(scratch / "tiny") if args.tiny else _model_dir(args.model)
    vocab, positions = _model_limits(model_dir)
    if args.max_prompt + args.max_tokens > positions:
        raise ValueError(f"--max-prompt {args.max_prompt} + --max-tokens {args.max_tokens} exceed the model's "
                         f"{positions} positions")
    return model_dir, make_workload(args.requests, args.min_prompt, args.max_prompt, args.max_tokens,
                                    args.concurrency, vocab, args.seed, args.temperature, args.request_rate)


def _tp(model_dir: Path, asked: int) -> int:
    """--tp, checked against the model's shapes (a ValueError that says what would work); by default the size
    `lockstep serve` would choose on this machine."""
    from lockstep.device import rank_capacity
    from lockstep.model.config import ModelConfig
    from lockstep.parallel.sharding import check_tp_size
    from lockstep.serve import default_tp

    if not asked:
        return default_tp(model_dir, rank_capacity())
    check_tp_size(ModelConfig.from_dir(model_dir), asked)
    return asked


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--control-plane"]:
        from lockstep.bench.control_plane_cli import main as control_plane

        return control_plane(argv[1:], prog="lockstep bench --control-plane")
    return _bench(argv)


def _bench(argv: list[str]) -> int:
    """The served run against the in-process run, as the flags say."""
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    try:
        try:
            model_dir, workload = _prepared(args, scratch)
            tp = 0 if args.url else _tp(model_dir, args.tp)
            cfg = BenchConfig(tp=tp, page_size=args.page_size, kv_pages=args.kv_pages,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                              prefix_caching=not args.no_prefix_caching, warmup=args.warmup, dtype=args.dtype,
                              api_workers=args.api_workers)
        except ValueError as exc:
            print(f"lockstep bench: {exc}", file=sys.stderr)
            return 2
        if args.url:
            return _external(args, model_dir, workload)
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
            "workload": _workload_json(args),
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


def _workload_json(args: argparse.Namespace) -> dict:
    return {"requests": args.requests, "min_prompt": args.min_prompt, "max_prompt": args.max_prompt,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "seed": args.seed,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate}


def _external(args: argparse.Namespace, model_dir: Path, workload) -> int:
    """Every --url in turn, loaded by the same client with the same text prompts; one table, one column each."""
    from lockstep.bench.external import Target, format_runs, run_external
    from lockstep.bench.workload import sampling_of
    from lockstep.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.decode(p) for p in workload.prompts]
    try:
        targets = [Target(url, args.served_model, args.api_key) for url in args.url]
        for t in targets:
            t.connection(1.0)  # the URL's form is checked before any run
    except ValueError as exc:
        print(f"lockstep bench: {exc}", file=sys.stderr)
        return 2
    try:
        runs = [run_external(t, prompts, workload.max_tokens, workload.concurrency, args.warmup,
                             sampling=lambda i: sampling_of(workload, i), wait_for=workload.wait_for)
                for t in targets]
    except (OSError, RuntimeError) as exc:  # a warmup request failed: a wrong key, a server not there
        print(f"lockstep bench: {exc}", file=sys.stderr)
        return 1
    print(format_runs(runs))
    for run in runs:
        for error in run.errors[:3]:
            print(f"{run.url}: {error}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"command": "lockstep bench " + " ".join(sys.argv[1:]),
                                         "runs": [r.summary() for r in runs]}, indent=2))
    return 0 if not any(r.errors for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
