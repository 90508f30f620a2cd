"""`lockstep coordinator`: connect to every rank of every group, then serve HTTP, gRPC and /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from lockstep.coordinator.grpc_api import start_grpc
from lockstep.coordinator.openai_api import OpenAIServer, run_app
from lockstep.coordinator.service import Coordinator, SchedulerLimits
from lockstep.tokenizer import Tokenizer


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def parse_groups(items: list[str]) -> dict[str, list[str]]:
    """`g0=host:port,host:port` items (or one `LOCKSTEP_GROUPS` string joined by ';') -> name -> addresses."""
    groups: dict[str, list[str]] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(";"))):
            name, sep, addrs = part.partition("=")
            if not sep or not addrs:
                raise ValueError(f"a group is NAME=HOST:PORT[,HOST:PORT...], got {part!r}")
            groups[name] = [a.strip() for a in addrs.split(",") if a.strip()]
    if not groups:
        raise ValueError("no group given: pass --group g0=HOST:PORT,... or set LOCKSTEP_GROUPS")
    return groups


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep coordinator", description=__doc__)
    p.add_argument("--group", action="append", default=[], help="NAME=HOST:PORT,HOST:PORT (ranks in order)")
    p.add_argument("--model", default=_env("LOCKSTEP_MODEL", "builtin"))
    p.add_argument("--served-model-name", default=_env("LOCKSTEP_SERVED_MODEL_NAME", ""))
    p.add_argument("--host", default=_env("LOCKSTEP_HOST", "0.0.0.0"))
    p.add_argument("--http-port", type=int, default=int(_env("LOCKSTEP_HTTP_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(_env("LOCKSTEP_GRPC_PORT", "8001")))
    p.add_argument("--page-size", type=int, default=int(_env("LOCKSTEP_PAGE_SIZE", "16")))
    p.add_argument("--max-num-batched-tokens", type=int, default=int(_env("LOCKSTEP_MAX_BATCHED_TOKENS", "512")))
    p.add_argument("--max-num-seqs", type=int, default=int(_env("LOCKSTEP_MAX_NUM_SEQS", "64")))
    p.add_argument("--stall-threshold", type=float, default=float(_env("LOCKSTEP_STALL_THRESHOLD_SECONDS", "5")))
    p.add_argument("--dead-rank-timeout", type=float,
                   default=float(_env("LOCKSTEP_DEAD_RANK_TIMEOUT_SECONDS", "30")))
    p.add_argument("--replay-timeout", type=float, default=float(_env("LOCKSTEP_REPLAY_TIMEOUT_SECONDS", "0")),
                   help="how long the requests of a group that went down wait for a group to serve them "
                        "(0: fail them at once with 503 when no other group is up)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=_env("LOCKSTEP_PREFIX_CACHING", "1") == "0")
    args = p.parse_args(argv)
    args.groups = parse_groups(args.group or [_env("LOCKSTEP_GROUPS", "")])
    return args


def resolve_model(model: str, progress: Callable[[str], None]) -> Path:
    if model == "builtin":
        from lockstep.model.builtin import ensure_builtin_model

        return ensure_builtin_model(progress=progress)
    return Path(model)


def model_name(model_dir: Path, given: str) -> str:
    if given:
        return given
    cfg = model_dir / "config.json"
    name = json.loads(cfg.read_text()).get("_name_or_path", "") if cfg.is_file() else ""
    return Path(name).name if name and not name.startswith("/") else model_dir.name


async def run(
    args: argparse.Namespace,
    on_ready: Callable[[], None] | None = None,
    children: list[subprocess.Popen] | None = None,
    progress: Callable[[str], None] = print,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model(args.model, progress)
    tokenizer = Tokenizer.from_dir(model_dir)
    limits = SchedulerLimits(args.page_size, args.max_num_batched_tokens, args.max_num_seqs,
                             not args.no_prefix_caching)
    config = json.loads((model_dir / "config.json").read_text())
    coord = Coordinator(args.groups, tokenizer, model_name(model_dir, args.served_model_name), limits,
                        int(config.get("max_position_embeddings", 2048)), args.stall_threshold,
                        args.dead_rank_timeout, args.replay_timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    progress(f"waiting for {sum(len(a) for a in args.groups.values())} rank(s) to load the model and form "
             f"their group(s)")
    coord.start()
    api = OpenAIServer(coord)
    runner = await run_app(api.app(), args.host, args.http_port)
    grpc_server = await start_grpc(api, args.host, args.grpc_port)
    ready = loop.create_task(coord.wait_ready())
    waiter = loop.create_task(stop.wait())
    watcher = loop.create_task(_watch_children(children or [], progress))
    done, _ = await asyncio.wait({ready, waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        if on_ready:
            on_ready()
        else:
            progress(f"serving http://{args.host}:{args.http_port}/v1 (gRPC on {args.grpc_port})")
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    else:
        ready.cancel()
    code = 0 if waiter in done else 1
    await grpc_server.stop(1)
    await runner.cleanup()
    await coord.close()
    return code


async def _watch_children(children: list[subprocess.Popen], progress: Callable[[str], None]) -> None:
    """Return when any supervised rank process exits (the embedded `lockstep serve` stops then)."""
    if not children:
        await asyncio.Event().wait()
    while True:
        for i, p in enumerate(children):
            if p.poll() is not None:
                progress(f"rank {i} exited with code {p.returncode}; stopping")
                return
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"lockstep coordinator: {exc}")
        return 2
    return asyncio.run(run(args))
