"""`lockstep rank`: one rank of one group, as a pod runs it (flags and env as in docs/commands.md).

The gRPC server starts first and says NOT_SERVING while the engine loads and the group forms its
collectives (which waits for every peer), so probes and the coordinator can tell "starting" from
"gone". It turns SERVING only once the engine is ready, and on SIGTERM it turns NOT_SERVING,
finishes the step in flight, ends the coordinator's stream and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lockstep.rank.service import RankServer, RankServicer, StepEngine

log = logging.getLogger("lockstep.rank")

DEFAULT_RENDEZVOUS = "127.0.0.1:29500"
DEFAULT_PORT = 50051
DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class RankConfig:
    rank: int
    world_size: int
    rendezvous: str
    host: str
    port: int
    model: str
    page_size: int
    kv_pages: int
    kv_memory_fraction: float | None
    prefix_caching: bool
    threads: int


class _Terminated(Exception):
    pass


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"lockstep rank: {name} must be an integer, got {value!r}") from None


def _env_float(env: Mapping[str, str], name: str) -> float | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"lockstep rank: {name} must be a number, got {value!r}") from None


def default_rank(env: Mapping[str, str], hostname: str) -> int | None:
    """The pod index: LOCKSTEP_POD_INDEX, else the StatefulSet hostname's ordinal (`name-g0-2` -> 2)."""
    index = _env_int(env, "LOCKSTEP_POD_INDEX")
    if index is not None:
        return index
    m = re.search(r"-(\d+)$", hostname)
    return int(m.group(1)) if m else None


def parse_args(
    argv: list[str] | None, env: Mapping[str, str] | None = None, hostname: str | None = None
) -> RankConfig:
    """Flags win over env, env over defaults; exits with a message naming the bad flag or variable."""
    env = os.environ if env is None else env
    hostname = socket.gethostname() if hostname is None else hostname
    p = argparse.ArgumentParser(
        prog="lockstep rank", description="Serve one rank of one tensor-parallel group."
    )
    p.add_argument("--rank", type=int, help="this rank (default: the pod index)")
    p.add_argument("--world-size", type=int, help="ranks in the group (default 1)")
    p.add_argument(
        "--rendezvous", help=f"host:port of rank 0's torch.distributed store ({DEFAULT_RENDEZVOUS})"
    )
    p.add_argument("--host", help="gRPC bind address (0.0.0.0)")
    p.add_argument("--port", type=int, help=f"gRPC port ({DEFAULT_PORT})")
    p.add_argument("--model", help="checkpoint directory, or 'builtin' (default)")
    p.add_argument("--page-size", type=int, help=f"tokens per KV page ({DEFAULT_PAGE_SIZE})")
    p.add_argument("--kv-pages", type=int, help="KV pages per pool (default 0: use the memory fraction)")
    p.add_argument("--kv-memory-fraction", type=float, help="share of free device memory for KV")
    p.add_argument("--no-prefix-caching", action="store_true", default=None, help="turn prefix caching off")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: cores / world size)")
    a = p.parse_args(argv)

    def pick(flag, name, read=None, default=None):
        if flag is not None:
            return flag
        value = (read or (lambda e, n: e.get(n) or None))(env, name)
        return default if value is None else value

    world_size = pick(a.world_size, "LOCKSTEP_WORLD_SIZE", _env_int, 1)
    if world_size < 1:
        p.error(f"--world-size must be >= 1, got {world_size}")
    rank = pick(a.rank, "LOCKSTEP_RANK", _env_int)
    if rank is None:
        rank = default_rank(env, hostname)
    if rank is None:
        if world_size > 1:
            p.error(
                f"cannot tell this rank: give --rank, LOCKSTEP_RANK or LOCKSTEP_POD_INDEX "
                f"(hostname {hostname!r} has no trailing -N)"
            )
        rank = 0
    if not 0 <= rank < world_size:
        p.error(f"rank {rank} is outside a group of {world_size} ranks (0..{world_size - 1})")
    rendezvous = pick(a.rendezvous, "LOCKSTEP_RENDEZVOUS", default=DEFAULT_RENDEZVOUS)
    if not re.fullmatch(r".+:\d+", rendezvous):
        p.error(f"--rendezvous must be host:port, got {rendezvous!r}")
    port = pick(a.port, "LOCKSTEP_GRPC_PORT", _env_int, DEFAULT_PORT)
    if not 0 <= port <= 65535:
        p.error(f"--port must be 0..65535, got {port}")
    page_size = pick(a.page_size, "LOCKSTEP_PAGE_SIZE", _env_int, DEFAULT_PAGE_SIZE)
    if page_size < 1:
        p.error(f"--page-size must be >= 1, got {page_size}")
    kv_pages = pick(a.kv_pages, "LOCKSTEP_KV_PAGES", _env_int, 0)
    if kv_pages < 0:
        p.error(f"--kv-pages must be >= 0, got {kv_pages}")
    fraction = pick(a.kv_memory_fraction, "LOCKSTEP_KV_MEMORY_FRACTION", _env_float)
    if fraction is not None and not 0.0 < fraction <= 1.0:
        p.error(f"--kv-memory-fraction must be in (0, 1], got {fraction}")
    if a.no_prefix_caching:
        prefix_caching = False
    else:
        flag = env.get("LOCKSTEP_PREFIX_CACHING", "1").strip().lower()
        if flag not in ("0", "1", "false", "true", "off", "on", "no", "yes", ""):
            p.error(f"LOCKSTEP_PREFIX_CACHING must be 0 or 1, got {flag!r}")
        prefix_caching = flag not in ("0", "false", "off", "no")
    threads = pick(a.threads, "LOCKSTEP_THREADS", _env_int, max(1, _cores() // world_size))
    if threads < 1:
        p.error(f"--threads must be >= 1, got {threads}")
    return RankConfig(
        rank=rank,
        world_size=world_size,
        rendezvous=rendezvous,
        host=pick(a.host, "LOCKSTEP_HOST", default="0.0.0.0"),
        port=port,
        model=pick(a.model, "LOCKSTEP_MODEL", default="builtin"),
        page_size=page_size,
        kv_pages=kv_pages,
        kv_memory_fraction=fraction,
        prefix_caching=prefix_caching,
        threads=threads,
    )


def create_engine(cfg: RankConfig) -> StepEngine:
    """The real engine; returns once its weights are loaded and the group's collectives are formed."""
    from lockstep.engine import Engine

    extra = {} if cfg.kv_memory_fraction is None else {"kv_memory_fraction": cfg.kv_memory_fraction}
    return Engine.create(
        model_dir=cfg.model,
        rank=cfg.rank,
        world_size=cfg.world_size,
        rendezvous=cfg.rendezvous,
        page_size=cfg.page_size,
        kv_pages=cfg.kv_pages,
        prefix_caching=cfg.prefix_caching,
        **extra,
    )


def run(cfg: RankConfig, engine_factory: Callable[[RankConfig], StepEngine] = create_engine) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status."""
    import torch

    torch.set_num_threads(cfg.threads)
    stop = threading.Event()
    loading = True

    def on_signal(signum: int, _frame) -> None:
        log.info("rank %d: %s received, shutting down", cfg.rank, signal.Signals(signum).name)
        stop.set()
        if loading:
            raise _Terminated()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    broken: list[str] = []

    def on_fatal(why: str) -> None:
        log.error("rank %d: %s; exiting so that the group is recreated", cfg.rank, why)
        broken.append(why)
        stop.set()

    servicer = RankServicer(cfg.rank, on_fatal=on_fatal)
    address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
    server = RankServer(servicer, address)
    server.start()
    log.info(
        "rank %d/%d: gRPC on %s:%d, loading %s", cfg.rank, cfg.world_size, cfg.host, server.port, cfg.model
    )
    try:
        try:
            engine = engine_factory(cfg)
        except _Terminated:
            return 0
        except Exception:
            log.exception("rank %d: the engine did not start", cfg.rank)
            return 1
        finally:
            loading = False
        if stop.is_set():
            return 0
        servicer.attach(engine)
        server.set_serving(True)
        log.info("rank %d/%d: SERVING", cfg.rank, cfg.world_size)
        stop.wait()
        return 3 if broken else 0
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.info("rank %d: stopped after step %d", cfg.rank, servicer.last_step)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
