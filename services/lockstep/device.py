"""The one place that decides which device a rank computes on and which collective backend it uses.

Everything else receives a `torch.device`; nothing else looks at CUDA or the environment, so a CPU test
run and a GPU pod differ in exactly one function.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "LOCKSTEP_DEVICE"


def pick_device(local_rank: int = 0) -> torch.device:
    """CUDA (one GPU per local rank) when present, else CPU; `LOCKSTEP_DEVICE` overrides both."""
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    if wanted:
        try:
            device = torch.device(wanted)
        except RuntimeError as e:
            raise ValueError(
                f"{DEVICE_ENV}={wanted!r} is not a device (use 'cpu', 'cuda' or 'cuda:N')") from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{DEVICE_ENV}={wanted!r}: only 'cpu' and 'cuda' devices are supported")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{DEVICE_ENV}={wanted!r} but CUDA is not available on this machine")
            if device.index is None:
                device = torch.device("cuda", local_rank % torch.cuda.device_count())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def device_slots() -> int:
    """How many ranks can compute side by side here: one per GPU, else one per CPU core this process may use
    (more ranks than cores make every collective wait on a descheduled peer)."""
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    if (not wanted or wanted.startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def dist_backend(device: torch.device | str) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones: the collectives must run where the activations live."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no collective backend for device type {kind!r}")
