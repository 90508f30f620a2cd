"""The one communication seam between the ranks of a tensor-parallel group.

The model calls only `all_reduce` and `all_gather`; whether they run over gloo, NCCL or (later) shared
memory is decided here, once, so a new transport never touches the model.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep.device import dist_backend


class Comm:
    """A rank's view of its group. World size 1 never touches torch.distributed."""

    def __init__(self, rank: int, world_size: int, backend: str | None = None, group=None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.group = group  # the process group the collectives run in (None: the default one)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place, and return it."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in rank order; every rank gets the same result."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Leave the process group (a torch.distributed group cannot take a new member later)."""
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
    return Comm(rank, world_size, backend, group)


def single_comm() -> Comm:
    """A group of one: every collective is the identity."""
    return Comm(0, 1)
