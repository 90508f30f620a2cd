"""`lockstep serve`: a coordinator and N rank processes on this machine, supervised as one.

The ranks are the same `lockstep rank` processes a pod runs; the coordinator runs in this process.
If a rank dies, the supervisor stops the others and starts the whole group again (as the operator
recreates a group), and the coordinator replays the requests it held there; Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from lockstep.coordinator.auth import parse_api_keys
from lockstep.coordinator.config import API_KEY_HELP, SCHEDULING, CoordinatorConfig
from lockstep.local_group import free_port
from lockstep.local_ranks import LocalRanks, rank_command
from lockstep.model.config import ModelConfig
from lockstep.parallel.sharding import valid_tp_sizes
from lockstep.rank_auth import RankClientAuth, env_with_token, new_token
from lockstep.settings import add_settings, resolve


def default_tp(model_dir: Path) -> int:
    """The smallest TP size above 1 that the model's shapes allow (3 for the built-in model), else 1."""
    return next((tp for tp in valid_tp_sizes(ModelConfig.from_dir(model_dir)) if tp > 1), 1)


def parse_args(argv: list[str] | None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep serve", description=__doc__)
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the built-in model)")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size (default: the smallest above 1 that the model allows)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; gRPC is served on the next one")
    p.add_argument("--kv-pages", type=int, default=0, help="KV pages per rank (default: from a memory budget)")
    p.add_argument("--rank-kv-pages", action="append", default=[], metavar="RANK=PAGES",
                   help="testing knob: give one rank a different KV pool size")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / TP)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help=API_KEY_HELP)
    add_settings(p, SCHEDULING)
    args = p.parse_args(argv)
    for name, value in resolve(p, args, SCHEDULING, os.environ if env is None else env).items():
        setattr(args, name, value)
    try:
        args.rank_pages = _rank_pages(args.rank_kv_pages)
        args.api_keys = parse_api_keys(args.api_key, (os.environ if env is None else env).get("LOCKSTEP_API_KEY", ""))
    except ValueError as exc:
        p.error(str(exc))
    return args


def _rank_pages(items: list[str]) -> dict[int, int]:
    pages = {}
    for item in items:
        rank, sep, n = item.partition("=")
        if not sep or not rank.strip().isdigit() or not n.strip().isdigit():
            raise ValueError(f"--rank-kv-pages takes RANK=PAGES, got {item!r}")
        pages[int(rank)] = int(n)
    return pages


def _model_dir(model: str | None, say) -> Path | None:
    if model is None:
        from lockstep.model.builtin import BuiltinModelUnavailable, ensure_builtin_model

        try:
            return ensure_builtin_model(progress=say)
        except BuiltinModelUnavailable as exc:
            say(str(exc))
            return None
    if not (Path(model) / "config.json").is_file():
        say(f"{model} is not a checkpoint directory (no config.json)")
        return None
    return Path(model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = lambda msg: print(f"lockstep: {msg}", file=sys.stderr, flush=True)
    model_dir = _model_dir(args.model, say)
    if model_dir is None:
        return 2
    tp = args.tp or default_tp(model_dir)
    threads = args.threads or max(1, (os.cpu_count() or 1) // tp)
    ports = [free_port() for _ in range(tp)]
    say(f"starting {tp} rank(s) of {model_dir.name} (page size {args.page_size})")
    token = new_token()  # the ranks serve only this coordinator; by environment, never on a command line
    ranks = LocalRanks(lambda rendezvous: [
        rank_command(r, tp, rendezvous, ports[r], model_dir, args.page_size, args.rank_pages.get(r, args.kv_pages),
                     threads, args.prefix_caching) for r in range(tp)], env_with_token(token, os.environ))
    ranks.start()
    config = CoordinatorConfig(rank_auth=RankClientAuth(token=token),
        groups={"g0": tuple(f"127.0.0.1:{p}" for p in ports)}, model=str(model_dir), host=args.host,
        http_port=args.port, grpc_port=args.port + 1, api_keys=args.api_keys,
        **{s.dest: getattr(args, s.dest) for s in SCHEDULING},
    )
    from lockstep.coordinator.main import run

    started = time.monotonic()

    def ready() -> None:
        say(f"group of {tp} rank(s) ready in {time.monotonic() - started:.1f} s")
        print(f"Lockstep is serving {model_dir.name} at http://{args.host}:{args.port}/v1 "
              f"(gRPC on {args.host}:{args.port + 1})", flush=True)

    try:
        return asyncio.run(run(config, on_ready=ready, supervise=ranks.supervise(say), progress=say))
    except KeyboardInterrupt:
        return 130
    finally:
        ranks.stop()
