"""`lockstep serve`: a coordinator and N rank processes on this machine, supervised as one.

The ranks are the same `lockstep rank` processes a pod runs; the coordinator runs in this process.
If any rank dies the supervisor stops the others and exits non-zero; Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lockstep.local_group import free_port


def default_tp(model_dir: Path) -> int:
    """The smallest TP size above 1 that the model's shapes allow (3 for the built-in model), else 1."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    dims = (heads, cfg["intermediate_size"], cfg["vocab_size"])
    for tp in range(2, heads + 1):
        if all(d % tp == 0 for d in dims) and (kv % tp == 0 or tp % kv == 0):
            return tp
    return 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep serve", description=__doc__)
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the built-in model)")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size (default: the smallest above 1 that the model allows)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; gRPC is served on the next one")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=0, help="KV pages per rank (default: from a memory budget)")
    p.add_argument("--rank-kv-pages", action="append", default=[], metavar="RANK=PAGES",
                   help="testing knob: give one rank a different KV pool size")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--stall-threshold", type=float, default=5.0)
    p.add_argument("--dead-rank-timeout", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / TP)")
    return p.parse_args(argv)


def rank_pages(args: argparse.Namespace, rank: int) -> int:
    for item in args.rank_kv_pages:
        r, _, n = item.partition("=")
        if int(r) == rank:
            return int(n)
    return args.kv_pages


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = lambda msg: print(f"lockstep: {msg}", file=sys.stderr, flush=True)
    if args.model is None:
        from lockstep.model.builtin import BuiltinModelUnavailable, ensure_builtin_model

        try:
            model_dir = ensure_builtin_model(progress=say)
        except BuiltinModelUnavailable as exc:
            say(str(exc))
            return 2
    else:
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            say(f"{model_dir} is not a checkpoint directory (no config.json)")
            return 2
    tp = args.tp or default_tp(model_dir)
    threads = args.threads or max(1, (os.cpu_count() or 1) // tp)
    rendezvous = f"127.0.0.1:{free_port()}"
    ports = [free_port() for _ in range(tp)]
    say(f"starting {tp} rank(s) of {model_dir.name} (page size {args.page_size})")
    procs = []
    for rank in range(tp):
        cmd = [sys.executable, "-m", "lockstep.cli", "rank", "--rank", str(rank), "--world-size", str(tp),
               "--rendezvous", rendezvous, "--host", "127.0.0.1", "--port", str(ports[rank]),
               "--model", str(model_dir), "--page-size", str(args.page_size),
               "--kv-pages", str(rank_pages(args, rank)), "--threads", str(threads)]
        if args.no_prefix_caching:
            cmd.append("--no-prefix-caching")
        procs.append(subprocess.Popen(cmd, start_new_session=True))
    coord = ["--group", "g0=" + ",".join(f"127.0.0.1:{p}" for p in ports), "--model", str(model_dir),
             "--host", args.host, "--http-port", str(args.port), "--grpc-port", str(args.port + 1),
             "--page-size", str(args.page_size), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--stall-threshold", str(args.stall_threshold), "--dead-rank-timeout", str(args.dead_rank_timeout)]
    if args.no_prefix_caching:
        coord.append("--no-prefix-caching")
    from lockstep.coordinator.main import parse_args as coord_args
    from lockstep.coordinator.main import run

    started = time.monotonic()

    def ready() -> None:
        say(f"group of {tp} rank(s) ready in {time.monotonic() - started:.1f} s")
        print(f"Lockstep is serving {model_dir.name} at http://{args.host}:{args.port}/v1 "
              f"(gRPC on {args.host}:{args.port + 1})", flush=True)

    try:
        return asyncio.run(run(coord_args(coord), on_ready=ready, children=procs, progress=say))
    except KeyboardInterrupt:
        return 130
    finally:
        stop_children(procs)


def stop_children(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
