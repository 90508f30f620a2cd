"""The one place that decides which device a rank computes on and which collective backend it uses.

Everything else receives a `torch.device`; nothing else looks at CUDA or the environment, so a CPU test
run and a GPU pod differ in exactly one function.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable

import torch

DEVICE_ENV = "LOCKSTEP_DEVICE"


class DeviceError(ValueError):
    """`LOCKSTEP_DEVICE` names no device this rank can use: a setting to fix, said in one line, not a bug."""


def pick_device(local_rank: int = 0) -> torch.device:
    """CUDA (one GPU per local rank) when present, else CPU; `LOCKSTEP_DEVICE` overrides both."""
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    if wanted:
        try:
            device = torch.device(wanted)
        except RuntimeError as e:
            raise DeviceError(
                f"{DEVICE_ENV}={wanted!r} is not a device (use 'cpu', 'cuda' or 'cuda:N')") from e
        if device.type not in ("cpu", "cuda"):
            raise DeviceError(f"{DEVICE_ENV}={wanted!r}: only 'cpu' and 'cuda' devices are supported")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError(f"{DEVICE_ENV}={wanted!r} but CUDA is not available on this machine")
            if device.index is None:
                device = torch.device("cuda", local_rank % torch.cuda.device_count())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def host_runs_ahead(device: torch.device) -> bool:
    """Whether the host goes on while `device` computes (CUDA queues kernels on a stream), so that a rank has time
    to prepare its next step during this one's forward. On the CPU a forward is done when its call returns."""
    return device.type == "cuda"


CUDA_POLL_S = 50e-6  # how often a rank waiting for its next plan looks whether its forward is done


def busy_probe(device: torch.device) -> Callable[[], float]:
    """For the work queued on `device` until now: how long to wait before asking again whether it still runs, 0
    once it is done. On CUDA an event recorded now and polled; on the CPU the work is done once its call returns."""
    if device.type != "cuda":
        return lambda: 0.0
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return lambda: 0.0 if done.query() else CUDA_POLL_S


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting on it: on CUDA through pinned memory, non-blocking (a blocking
    copy first waits for every kernel queued before it, so a rank preparing its next step would stall until this
    step's forward ends). On the CPU, the tensor itself; elsewhere (the tests' meta device) a plain copy."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)


def host_staging(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host buffer that `to_device` sends to `device` without a second host copy: pinned for CUDA."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def pick_dtype(requested: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """The dtype the weights and KV pages are held in. `auto`: float32 on the CPU (its matmuls are no faster in
    half precision there, and it is what the parity tests hold it to); on a GPU the checkpoint's own half
    dtype, and bfloat16 for a float32 (or unstated) one. vLLM's auto picks float16 there; bfloat16 keeps
    float32's range, so no activation that fits in the checkpoint overflows."""
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


def rank_capacity() -> int:
    """How many local ranks this machine runs without a collective waiting long on a descheduled peer: one per
    GPU; on the CPU two per core when the ranks reduce through shared memory (a sleeping waiter frees its
    core: three ranks on two cores measured 1.33x the inter-token latency of one rank), else one per core
    (over gloo's TCP loopback the same three ranks took 3.7x)."""
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    if (not wanted or wanted.startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.device_count()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    shm = platform.machine() in ("x86_64", "AMD64") and os.environ.get("LOCKSTEP_COMM", "auto").strip() != "gloo"
    return 2 * cores if shm else cores


def dist_backend(device: torch.device | str) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones: the collectives must run where the activations live."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no collective backend for device type {kind!r}")


def attention_call_tokens(device: torch.device | str) -> int:
    """What one more decode attention call costs, in gathered key slots: how `AttentionBatch` weighs padding
    against calls when it groups decode rows by length. 256 was measured on the CPU (2 threads). On a GPU a
    call is a handful of kernel launches, some 30 us of host time, while gathering one key slot's k and v
    (4 KB a layer for an 8B model) takes a few ns at HBM bandwidth: about 16k slots per call. Reasoned, not
    measured (no GPU was lent to this task); a long row among short ones still gets its own call."""
    return 256 if torch.device(device).type == "cpu" else 16384
