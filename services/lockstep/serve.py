"""`lockstep serve`: a coordinator and `--dp` groups of `--tp` rank processes on this machine.

The ranks are the same `lockstep rank` processes a pod runs; the coordinator runs in this process.
Each group (g0, g1, ...) is supervised on its own: if a rank dies, the supervisor stops the others of
that group and starts that group again (as the operator recreates a group), while the coordinator
replays the requests it held there on the groups still up; Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from lockstep.coordinator.auth import parse_api_keys
from lockstep.coordinator.config import API_KEY_HELP, FRONTENDS, REBALANCE, SCHEDULING, CoordinatorConfig
from lockstep.engine_config import DTYPE
from lockstep.local_group import free_port
from lockstep.local_ranks import LocalRanks, rank_command, stop_groups, supervise_all
from lockstep.model.checkpoint_files import check_checkpoint
from lockstep.model.config import ModelConfig
from lockstep.parallel.sharding import check_tp_size, valid_tp_sizes
from lockstep.rank_auth import RankClientAuth, env_with_token, new_token
from lockstep.settings import Setting, add_settings, at_least, integer, resolve
from lockstep.tokenizer import Tokenizer

DP = Setting("dp", "--dp", "LOCKSTEP_DP", integer, 1,
             "data-parallel size: local groups g0..g{N-1} of --tp ranks each", at_least(1))


def default_tp(model_dir: Path, slots: int, dp: int = 1) -> int:
    """The smallest TP size above 1 that the model's shapes allow and whose `dp` groups fit in `slots` ranks
    (`device.rank_capacity`: a GPU each, or up to two per CPU core with shared-memory collectives); else 1. So
    the first run is a real group where that costs little, and one fast rank where it would not."""
    return next((tp for tp in valid_tp_sizes(ModelConfig.from_dir(model_dir)) if 1 < tp and tp * dp <= slots), 1)


def parse_args(argv: list[str] | None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep serve", description=__doc__)
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the built-in model)")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size (default: the smallest above 1 that the model allows and "
                        "this machine has a core or GPU per rank for; else 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; gRPC is served on the next one")
    p.add_argument("--kv-pages", type=int, default=0, help="KV pages per rank (default: from a memory budget)")
    p.add_argument("--rank-kv-pages", action="append", default=[], metavar="[GROUP:]RANK=PAGES",
                   help="testing knob: give one rank a different KV pool size (GROUP: 0..dp-1, default 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / (TP x DP))")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help=API_KEY_HELP)
    add_settings(p, (DP, DTYPE, *SCHEDULING, *FRONTENDS, *REBALANCE))
    args = p.parse_args(argv)
    for name, value in resolve(p, args, (DP, DTYPE, *SCHEDULING, *FRONTENDS, *REBALANCE),
                               os.environ if env is None else env).items():
        setattr(args, name, value)
    try:
        args.rank_pages = _rank_pages(args.rank_kv_pages, args.dp)
        args.api_keys = parse_api_keys(args.api_key, (os.environ if env is None else env).get("LOCKSTEP_API_KEY", ""))
        CoordinatorConfig(groups={"g0": ("127.0.0.1:1",)}, **coordinator_settings(args))  # before any rank starts
    except ValueError as exc:
        p.error(str(exc))
    return args


def coordinator_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The coordinator's own settings as `lockstep serve` read them, so that every flag `lockstep coordinator`
    takes (scheduling, API frontends, rebalance) means the same here and none is dropped on the way."""
    return {s.dest: getattr(args, s.dest) for s in SCHEDULING + FRONTENDS + REBALANCE}


def _rank_pages(items: list[str], dp: int = 1) -> dict[tuple[int, int], int]:
    """(group, rank) -> pages. A bare `RANK=PAGES` means group 0, so the one-group form keeps its meaning."""
    pages: dict[tuple[int, int], int] = {}
    for item in items:
        where, sep, n = item.partition("=")
        group, colon, rank = where.rpartition(":")
        group = group.strip().removeprefix("g") if colon else "0"
        if not sep or not rank.strip().isdigit() or not n.strip().isdigit() or not group.isdigit():
            raise ValueError(f"--rank-kv-pages takes RANK=PAGES or GROUP:RANK=PAGES, got {item!r}")
        if int(group) >= dp:
            raise ValueError(f"--rank-kv-pages names group {group}, but --dp is {dp}")
        pages[(int(group), int(rank))] = int(n)
    return pages


def _model_dir(model: str | None, say) -> Path | None:
    if model is None or model.startswith("builtin"):
        from lockstep.model.builtin import BuiltinModelUnavailable, resolve_model

        try:
            return resolve_model(model or "builtin", progress=say)
        except (BuiltinModelUnavailable, ValueError) as exc:
            say(str(exc))
            return None
    if not (Path(model) / "config.json").is_file():
        gguf = " (a GGUF file is served only as a built-in's source, not with --model)" * model.endswith(".gguf")
        say(f"{model} is not a checkpoint directory (no config.json){gguf}")
        return None
    return Path(model)


def _groups(args: argparse.Namespace, model_dir: Path, tp: int, threads: int,
            env: Mapping[str, str]) -> dict[str, tuple[LocalRanks, list[int]]]:
    """Each local group's supervisor and rank ports; a group keeps its ports across restarts so that the
    coordinator finds it where it was."""
    groups: dict[str, tuple[LocalRanks, list[int]]] = {}
    for g in range(args.dp):
        ports = [free_port() for _ in range(tp)]

        def commands(rendezvous: str, g: int = g, ports: list[int] = ports) -> list[list[str]]:
            return [rank_command(r, tp, rendezvous, ports[r], model_dir, args.page_size,
                                 args.rank_pages.get((g, r), args.kv_pages), threads, args.prefix_caching, args.dtype)
                    for r in range(tp)]

        groups[f"g{g}"] = (LocalRanks(commands, env, name=f"g{g}"), ports)
    return groups


def _default_tp(model_dir: Path, dp: int, say: Callable[[str], None]) -> int:
    from lockstep.device import rank_capacity

    slots = rank_capacity()
    tp = default_tp(model_dir, slots, dp)
    smallest = next((t for t in valid_tp_sizes(ModelConfig.from_dir(model_dir)) if t > 1), 1)
    if tp == 1 and smallest > 1:
        say(f"TP 1: the smallest group {model_dir.name} allows is {smallest} ranks, and {dp} group(s) of them "
            f"are more than this machine runs side by side ({slots}: a rank per GPU, or up to two per CPU core "
            f"with shared-memory collectives); pass --tp {smallest} to serve it as a group anyway")
    return tp


def taken_port(host: str, ports: Iterable[int]) -> str | None:
    """Why one of `ports` cannot be listened on at `host`, or None. Asked before any rank starts: otherwise a port
    another server holds is found only once the ranks have loaded the model. Every address `host` names is tried,
    as the HTTP server binds every one (localhost: ::1 and 127.0.0.1 where /etc/hosts names both); one of a family
    this machine lacks (EADDRNOTAVAIL) only where none binds."""
    for port in ports:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            errors = [e for e in map(_bind_error, infos) if e is not None]
            held = [e for e in errors if e.errno != errno.EADDRNOTAVAIL]
            if held or len(errors) == len(infos):
                raise (held or errors)[0]
        except OSError as exc:
            return (f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server there? --port P takes "
                    f"P for HTTP and P+1 for gRPC)")
    return None


def _bind_error(info: tuple) -> OSError | None:
    try:
        with socket.socket(info[0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is free
            sock.bind(info[4])
    except OSError as exc:
        return exc
    return None


def main(argv: list[str] | None = None) -> int:
    from lockstep.coordinator.stopping import dump_on_sigusr1

    dump_on_sigusr1()  # from the first moment: the model's import and the ranks' start may be where it waits
    args = parse_args(argv)
    say = lambda msg: print(f"lockstep: {msg}", file=sys.stderr, flush=True)
    model_dir = _model_dir(args.model, say)
    if model_dir is None:
        return 2
    try:  # here, not in each rank: what cannot serve the model would fail every rank, restart after restart
        tp = args.tp or _default_tp(model_dir, args.dp, say)
        check_tp_size(ModelConfig.from_dir(model_dir), tp)
        check_checkpoint(model_dir)
        Tokenizer.from_dir(model_dir)
    except (ValueError, OSError) as exc:  # TPConfigError, UnsupportedModelError, CheckpointError: ValueErrors
        say(str(exc))
        return 2
    taken = taken_port(args.host, (args.port, args.port + 1))
    if taken is not None:
        say(taken)
        return 1
    threads = args.threads or max(1, (os.cpu_count() or 1) // (tp * args.dp))
    token = new_token()  # the ranks serve only this coordinator; by environment, never on a command line
    groups = _groups(args, model_dir, tp, threads, env_with_token(token, os.environ))
    say(f"starting {args.dp} group(s) of {tp} rank(s) of {model_dir.name} (page size {args.page_size})"
        if args.dp > 1 else f"starting {tp} rank(s) of {model_dir.name} (page size {args.page_size})")
    for name, (ranks, ports) in groups.items():
        say(f"{name}: rank ports {' '.join(map(str, ports))}")
        ranks.start()
    config = CoordinatorConfig(rank_auth=RankClientAuth(token=token),
        groups={name: tuple(f"127.0.0.1:{p}" for p in ports) for name, (_, ports) in groups.items()},
        model=str(model_dir), host=args.host, http_port=args.port, grpc_port=args.port + 1,
        api_keys=args.api_keys, **coordinator_settings(args),
    )
    from lockstep.coordinator.main import run
    from lockstep.coordinator.stopping import errors_exit, exit_status, run_to_end

    started = time.monotonic()

    def ready() -> None:
        say(f"{args.dp} group(s) of {tp} rank(s): the first ready in {time.monotonic() - started:.1f} s")
        print(f"Lockstep is serving {model_dir.name} at http://{args.host}:{args.port}/v1 "
              f"(gRPC on {args.host}:{args.port + 1})", flush=True)

    supervisors = [ranks for ranks, _ in groups.values()]
    with errors_exit():  # after the ranks' stop: an error must not wait on an executor thread for ever either
        try:
            code = run_to_end(run(config, on_ready=ready, supervise=supervise_all(supervisors, say), progress=say,
                                  on_group_up=lambda name: groups[name][0].mark_whole()))
        except KeyboardInterrupt:
            code = 130
        finally:
            stop_groups(supervisors)
    return exit_status(code)
