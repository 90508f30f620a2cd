"""The one communication seam between the ranks of a tensor-parallel group.

The model calls only `all_reduce` and `all_gather`; whether they run over gloo, NCCL or shared memory is
decided here, once (`init_comm`), so a new transport never touches the model.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep.device import dist_backend
from lockstep.parallel.group_watch import GroupWatch, mark_formed, wait_for_fresh_store, watch_group
from lockstep.parallel.shm_allreduce import ShmAllReduce, join_group

log = logging.getLogger("lockstep.comm")
COMM_ENV = "LOCKSTEP_COMM"
COMM_MODES = ("auto", "shm", "gloo")


class Comm:
    """A rank's view of its group. World size 1 never touches torch.distributed."""

    def __init__(self, rank: int, world_size: int, backend: str | None = None, group=None,
                 shm: ShmAllReduce | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.group = group  # the process group the collectives run in (None: the default one)
        self.shm = shm  # when set, all_reduce and all_gather go through shared memory instead
        self.watch: GroupWatch | None = None  # polls the group's store while it stands (group_watch.py)

    @property
    def transport(self) -> str:
        """What the collectives run over: 'shm', 'gloo', 'nccl' or 'none' (a group of one)."""
        return "shm" if self.shm is not None else self.backend or "none"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place, and return it."""
        if self.shm is not None:
            return self.shm.all_reduce(t)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in rank order; every rank gets the same result."""
        if self.world_size == 1:
            return t
        if self.shm is not None:
            return self.shm.all_gather(t, dim)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Leave the process group (a torch.distributed group cannot take a new member later)."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def parse_rendezvous(rendezvous: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port), with an error that says what was wrong."""
    host, sep, port = rendezvous.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous {rendezvous!r} is not 'host:port' with a port in 1..65535")
    return host, int(port)


def init_comm(
    rank: int, world_size: int, rendezvous: str, device: torch.device | str, timeout_s: float = 600.0,
    collective_timeout_s: float | None = None,
) -> Comm:
    """Join the group whose rank 0 serves the TCP store at `rendezvous`; blocks until all ranks arrive.

    `timeout_s` bounds the rendezvous (peers may take minutes to be scheduled and load); with
    `collective_timeout_s`, each collective fails after that long instead, so a rank whose peer died or
    stopped finds its group broken soon (and exits to have it recreated) rather than after `timeout_s`.
    On CPU, ranks of one host reduce through shared memory unless `LOCKSTEP_COMM` says otherwise
    (`select_shm`); gloo's groups stay up regardless, for the barrier and as the fallback.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of world size {world_size}")
    if world_size == 1:
        return single_comm()
    host, port = parse_rendezvous(rendezvous)
    device = torch.device(device)
    backend = dist_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; one group per process")
    if rank > 0:  # rank 0 makes the store; the others must not join one whose group formed without them
        wait_for_fresh_store(host, port, rank, timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    group = None
    if collective_timeout_s is not None:
        group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=collective_timeout_s),
                               backend=backend)
    shm = None
    if device.type == "cpu":
        shm = select_shm(rank, world_size, collective_timeout_s or timeout_s)
    elif os.environ.get(COMM_ENV, "").strip().lower() == "shm":
        log.warning("rank %d: %s=shm ignored: the tensors live on %s, so NCCL carries them", rank, COMM_ENV, device)
    comm = Comm(rank, world_size, backend, group, shm)
    mark_formed(host, port)  # by every rank, before its watch looks for the mark (rank 0 may come later)
    comm.watch = watch_group(host, port)
    log.info("rank %d: collectives over %s", rank, comm.transport)
    return comm


def host_identity() -> str:
    """Hostname and boot id: ranks that agree on both are processes of one running machine (or one pod)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def select_shm(rank: int, world_size: int, timeout_s: float) -> ShmAllReduce | None:
    """The group's shared-memory transport, or None for gloo; a collective, decided alike on every rank.

    Every rank's `LOCKSTEP_COMM`, host and machine are gathered first (`choose_shm`), so the ranks choose
    together even if their settings differ; auto falls back to gloo when the segment cannot be mapped.
    """
    views: list[tuple[str, str, str]] = [("", "", "")] * world_size
    mine = (os.environ.get(COMM_ENV, "").strip().lower() or "auto", host_identity(), platform.machine())
    dist.all_gather_object(views, mine)
    use, forced = choose_shm(views)
    if not use:
        return None
    try:
        return join_group(rank, world_size, timeout_s)
    except OSError as exc:
        if forced:
            raise RuntimeError(f"{COMM_ENV}=shm but {exc}") from exc
        log.warning("rank %d: shared-memory collectives unavailable, using gloo: %s", rank, exc)
        return None


def choose_shm(views: list[tuple[str, str, str]]) -> tuple[bool, bool]:
    """(use shared memory, insisted on) from every rank's (LOCKSTEP_COMM, host identity, machine).

    auto (the default) takes shared memory on one x86-64 host (publishing a slot relies on its store
    order); shm insists, and is an error across hosts; gloo, on any rank, keeps gloo.
    """
    modes = {m for m, _, _ in views}
    if not modes <= set(COMM_MODES) or {"shm", "gloo"} <= modes:
        raise ValueError(f"{COMM_ENV} must be one of {COMM_MODES} and agree between ranks; the ranks have "
                         f"{[m for m, _, _ in views]}")
    forced = "shm" in modes
    if len({h for _, h, _ in views}) > 1:
        if forced:
            raise RuntimeError(f"{COMM_ENV}=shm but the ranks are on different hosts: {[h for _, h, _ in views]}")
        return False, False
    if "gloo" in modes:
        return False, False
    return forced or all(m in ("x86_64", "AMD64") for _, _, m in views), forced


def single_comm() -> Comm:
    """A group of one: every collective is the identity."""
    return Comm(0, 1)
