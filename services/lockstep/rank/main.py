"""`lockstep rank`: one rank of one group, as a pod runs it (flags and env as in docs/commands.md).

The gRPC server starts first and says NOT_SERVING while the engine loads and the group forms its
collectives (which waits for every peer), so probes and the coordinator can tell "starting" from
"gone". It turns SERVING only once the engine is ready, and on SIGTERM it turns NOT_SERVING,
finishes the step in flight, ends the coordinator's stream and exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from lockstep.engine_config import DTYPE, EngineConfig
from lockstep.local_ranks import EXIT_GROUP_BROKEN, EXIT_UNSERVABLE
from lockstep.model.checkpoint_files import CheckpointError
from lockstep.model.config import UnsupportedModelError
from lockstep.parallel.group_watch import on_group_broken
from lockstep.rank.service import RankServer, RankServicer, StepEngine
from lockstep.rank_auth import RANK_SETTINGS, RankServerAuth, server_auth
from lockstep.settings import Setting, add_settings, at_least, integer, number, resolve, within
from lockstep.steps import Plan, RankInfo, Report

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
    auth: RankServerAuth = field(default_factory=RankServerAuth)  # the group token and TLS of the gRPC port
    collective_timeout: float = 60.0
    dtype: str = "auto"
    health_port: int | None = None  # a plaintext port with grpc.health.v1 alone, for probes that cannot do TLS

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, rank=self.rank, world_size=self.world_size, rendezvous=self.rendezvous,
                            page_size=self.page_size, kv_pages=self.kv_pages,
                            kv_memory_fraction=self.kv_memory_fraction, prefix_caching=self.prefix_caching,
                            collective_timeout_s=self.collective_timeout, dtype=self.dtype)


class _Terminated(Exception):
    pass


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


SETTINGS = (
    Setting("world_size", "--world-size", "LOCKSTEP_WORLD_SIZE", integer, 1, "ranks in the group", at_least(1)),
    Setting("rank", "--rank", "LOCKSTEP_RANK", integer, None, "this rank (default: the pod index)", at_least(0)),
    Setting("rendezvous", "--rendezvous", "LOCKSTEP_RENDEZVOUS", default=DEFAULT_RENDEZVOUS,
            help="host:port of rank 0's torch.distributed store",
            check=lambda v: "" if re.fullmatch(r".+:\d+", v) else f"must be host:port, got {v!r}"),
    Setting("host", "--host", "LOCKSTEP_HOST", default="0.0.0.0", help="gRPC bind address"),
    Setting("port", "--port", "LOCKSTEP_GRPC_PORT", integer, DEFAULT_PORT, "gRPC port", within(0, 65535)),
    Setting("model", "--model", "LOCKSTEP_MODEL", default="builtin",
            help="checkpoint directory, 'builtin' (SmolLM2-135M-Instruct) or 'builtin:gemma3-270m'"),
    Setting("page_size", "--page-size", "LOCKSTEP_PAGE_SIZE", integer, DEFAULT_PAGE_SIZE, "tokens per KV page",
            at_least(1)),
    Setting("kv_pages", "--kv-pages", "LOCKSTEP_KV_PAGES", integer, 0,
            "KV pages per pool (0: use the memory fraction)", at_least(0)),
    Setting("kv_memory_fraction", "--kv-memory-fraction", "LOCKSTEP_KV_MEMORY_FRACTION", number, None,
            "share of free device memory for KV", within(0, 1, low_open=True)),
    Setting("prefix_caching", "--no-prefix-caching", "LOCKSTEP_PREFIX_CACHING", default=True,
            help="turn prefix caching off", switch=True, flag_value=False),
    Setting("threads", "--threads", "LOCKSTEP_THREADS", integer, None,
            "torch intra-op threads (default: cores / world size)", at_least(1)),
    DTYPE,
    Setting("collective_timeout", "--collective-timeout", "LOCKSTEP_COLLECTIVE_TIMEOUT_SECONDS", number, 60.0,
            "seconds after which a collective whose peer never comes fails, and the rank exits to have its "
            "group recreated", within(0, 86400, low_open=True)),
    Setting("health_port", "--health-port", "LOCKSTEP_HEALTH_PORT", integer, None,
            "also serve grpc.health.v1 alone, in plaintext, on this port (for the kubelet's gRPC probes, which "
            "cannot speak TLS, when --tls-cert is set); RankService stays on --port only", within(0, 65535)),
)


def default_rank(env: Mapping[str, str], hostname: str) -> int | None:
    """The pod index: LOCKSTEP_POD_INDEX, else the StatefulSet hostname's ordinal (`name-g0-2` -> 2)."""
    index = env.get("LOCKSTEP_POD_INDEX", "").strip()
    if index:
        try:
            return integer(index)
        except ValueError as exc:
            raise SystemExit(f"lockstep rank: LOCKSTEP_POD_INDEX {exc}, got {index!r}") from None
    m = re.search(r"-(\d+)$", hostname)
    return int(m.group(1)) if m else None


def parse_args(
    argv: list[str] | None, env: Mapping[str, str] | None = None, hostname: str | None = None
) -> RankConfig:
    """Flags win over env, env over defaults; exits with a message naming the bad flag or variable."""
    env = os.environ if env is None else env
    hostname = socket.gethostname() if hostname is None else hostname
    p = argparse.ArgumentParser(prog="lockstep rank", description="Serve one rank of one tensor-parallel group.")
    add_settings(p, SETTINGS + RANK_SETTINGS)
    args = p.parse_args(argv)
    values = resolve(p, args, SETTINGS, env)
    try:
        values["auth"] = server_auth(resolve(p, args, RANK_SETTINGS, env), env)
    except ValueError as exc:
        p.error(str(exc))
    world_size = values["world_size"]
    if values["rank"] is None:
        values["rank"] = default_rank(env, hostname)
    if values["rank"] is None:
        if world_size > 1:
            p.error(
                f"cannot tell this rank: give --rank, LOCKSTEP_RANK or LOCKSTEP_POD_INDEX "
                f"(hostname {hostname!r} has no trailing -N)"
            )
        values["rank"] = 0
    if not 0 <= values["rank"] < world_size:
        p.error(f"rank {values['rank']} is outside a group of {world_size} ranks (0..{world_size - 1})")
    if values["threads"] is None:
        values["threads"] = max(1, _cores() // world_size)
    if values["health_port"] is not None and values["health_port"] == values["port"] != 0:
        p.error(f"--health-port (LOCKSTEP_HEALTH_PORT) must differ from --port, both are {values['port']}")
    return RankConfig(**values)


def create_engine(cfg: RankConfig) -> StepEngine:
    """The real engine; returns once its weights are loaded and the group's collectives are formed."""
    from lockstep.engine import Engine

    return Engine.create(cfg.engine_config())


class EngineThread:
    """One thread of its own for every torch call of the rank: it builds the engine and carries out every step.

    torch's CPU kernels run on an OpenMP team per calling thread. With the engine built on the main thread and
    its steps run on the rank service's threads, two teams of spinning threads share the cores, and a
    decode step at batch 32 took 1.9x as long as in one thread (lockstep bench, TP 1: 397 against 205 ms).
    A daemon thread, so a rank told to stop while it loads or sits in a collective still exits. Its steps run
    here only for ranks of more than one torch thread: with one there is no team, and the hop to this thread and
    back costs a rank sharing its core with others (`lockstep serve --tp 3` on two cores: 1.78 s first curl
    against 2.19); such a rank still builds its engine here, so that its main thread stays free for SIGTERM.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    def call(self, fn: Callable, *args: object) -> Future:
        fut: Future = Future()
        self._calls.put((fn, args, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, args, fut = self._calls.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # the caller's to handle, as if it had called fn itself
                    fut.set_exception(exc)


class _OnEngineThread:
    """The engine as the servicer sees it, each step carried out on the engine's thread."""

    def __init__(self, engine: StepEngine, thread: EngineThread) -> None:
        self.engine = engine
        self.thread = thread
        if hasattr(engine, "stage"):  # called by `ahead` inside the step, so on the engine thread already: directly
            self.stage = engine.stage

    def step(self, plan: Plan, ahead: Callable | None = None) -> Report:
        args = (plan,) if ahead is None else (plan, ahead)  # `ahead` only to an engine that prepares ahead
        return self.thread.call(self.engine.step, *args).result()

    def info(self) -> RankInfo:
        return self.engine.info()


class _Ending:
    """Why the rank stops: told to (exit 0), or its group broke (exit EXIT_GROUP_BROKEN, to be made anew)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.stop = threading.Event()
        self.broken: list[str] = []

    def fatal(self, why: str) -> None:
        """The step's failure (rank/service.py) or the group's watch (group_watch.py) found the group broken."""
        if self.stop.is_set() and not self.broken:
            # told to stop: so are its peers, and a step that some of them left unrun fails here (`lockstep
            # serve`'s Ctrl-C under load, one time in three at TP 3), or the watch saw rank 0 go first: the
            # group is going away, not broken
            log.warning("rank %d: %s, while stopping as told", self.rank, why)
            return
        log.error("rank %d: %s; exiting so that the group is recreated", self.rank, why)
        self.broken.append(why)
        self.stop.set()

    @property
    def code(self) -> int:
        return EXIT_GROUP_BROKEN if self.broken else 0


def run(cfg: RankConfig, engine_factory: Callable[[RankConfig], StepEngine] = create_engine) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status."""
    import torch
    torch.set_num_threads(cfg.threads)
    ending = _Ending(cfg.rank)
    stop = ending.stop
    loading = True

    def on_signal(signum: int, _frame) -> None:
        log.info("rank %d: %s received, shutting down", cfg.rank, signal.Signals(signum).name)
        stop.set()
        if loading:
            raise _Terminated()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    parent = os.environ.get(PARENT_PID_ENV, "")
    if parent.isdigit():
        threading.Thread(target=_watch_parent, args=(int(parent), cfg.rank), daemon=True,
                         name="parent-watch").start()
    servicer = RankServicer(cfg.rank, on_fatal=ending.fatal)
    on_group_broken(ending.fatal)
    server = RankServer(servicer, _address(cfg.host, cfg.port), auth=cfg.auth,
                        health_address=None if cfg.health_port is None else _address(cfg.host, cfg.health_port))
    server.start()
    log.info("rank %d/%d: gRPC%s on %s:%d (group token %s)%s, loading %s", cfg.rank, cfg.world_size,
             " over TLS" if cfg.auth.tls_cert else "", cfg.host, server.port,
             "required" if cfg.auth.token else "NOT required",
             "" if server.health_port is None else f", plaintext health checks on port {server.health_port}",
             cfg.model)
    try:
        try:
            engine = _start_engine(engine_factory, cfg, lambda: bool(ending.broken))
        except _Terminated:
            return ending.code
        except Exception as exc:
            return _start_failed(cfg, exc)
        finally:
            loading = False
        if stop.is_set():
            return ending.code
        servicer.attach(engine)
        server.set_serving(True)
        log.info("rank %d/%d: SERVING", cfg.rank, cfg.world_size)
        stop.wait()
        return ending.code
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.info("rank %d: stopped after step %d", cfg.rank, servicer.last_step)


def _start_failed(cfg: RankConfig, exc: Exception) -> int:
    """The exit status of a rank whose engine did not start, with one log line saying why (a traceback only for
    what no one foresaw)."""
    from torch.distributed import DistNetworkError

    from lockstep.device import DeviceError

    if isinstance(exc, CheckpointError | UnsupportedModelError):
        log.error("rank %d: %s cannot be served: %s", cfg.rank, cfg.model, exc)
        return EXIT_UNSERVABLE  # whoever starts ranks need not start this one again: it would fail alike
    if isinstance(exc, DeviceError):  # LOCKSTEP_DEVICE: a setting to fix, not a bug (docs/commands.md)
        log.error("rank %d: %s", cfg.rank, exc)
        return 1
    if isinstance(exc, DistNetworkError):  # rank 0's store went while the group formed (it was killed)
        log.error("rank %d: the group's rendezvous failed (%s); exiting so that the group is recreated",
                  cfg.rank, exc)
        return EXIT_GROUP_BROKEN
    log.error("rank %d: the engine did not start", cfg.rank, exc_info=exc)
    return 1


PARENT_PID_ENV = "LOCKSTEP_PARENT_PID"  # set by `lockstep serve`: the process whose ranks these are
PARENT_POLL_S = 1.0
LOADING_POLL_S = 0.5  # how soon a rank whose group broke while it loads gives the load up


def _watch_parent(pid: int, rank: int) -> None:
    """Stop the rank (SIGTERM to itself, the graceful way) once the process that started it is gone: `lockstep
    serve` killed (-9), or hung up on (its ranks run in sessions of their own, so its terminal's SIGHUP never
    reaches them), would otherwise leave them running with the model loaded, for ever."""
    while os.getppid() == pid:
        time.sleep(PARENT_POLL_S)
    log.error("rank %d: the process that started it (pid %d) is gone; shutting down", rank, pid)
    os.kill(os.getpid(), signal.SIGTERM)


def _start_engine(factory: Callable[[RankConfig], StepEngine], cfg: RankConfig,
                  broken: Callable[[], bool] = lambda: False) -> StepEngine:
    """The engine, built on an engine thread of its own; where the rank runs several torch threads its steps run
    there too (EngineThread), with one they run on each Step stream's step thread (rank/service.py).

    Never built on the main thread: the group's rendezvous blocks in torch's C++ (the TCP store waits for every
    peer, up to its 10-minute timeout) and Python runs the SIGTERM handler only once that call returns, so a rank
    told to stop while its peers had not come kept waiting, until the kubelet's SIGKILL or `lockstep serve`'s."""
    thread = EngineThread()
    made = thread.call(_create, factory, cfg)
    while not wait([made], timeout=LOADING_POLL_S).done:
        if broken():  # the group's watch found it broken while the model loads: no need to wait for the load
            raise _Terminated()
    engine = made.result()
    return engine if cfg.threads <= 1 else _OnEngineThread(engine, thread)


def _create(factory: Callable[[RankConfig], StepEngine], cfg: RankConfig) -> StepEngine:
    import torch

    torch.set_num_threads(cfg.threads)
    return factory(cfg)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _exit_now(run(parse_args(argv)))
    return 0  # not reached


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: torch.distributed's C++ threads, whose peer died mid-collective
    or that still wait at the rendezvous, abort the process when destroyed ("terminate called without an active
    exception", SIGABRT), so the exit status would say the rank crashed, not why it stopped (seen about one
    time in four at TP 2 after a peer died)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # C's buffers too (NCCL_DEBUG writes to stdout, block-buffered in a pod): exit() would flush them
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
