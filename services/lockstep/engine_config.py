"""What one rank's engine is built from: one object, validated once, with no torch in it.

`lockstep rank` builds it from flags and environment, LocalGroup from its arguments; `Engine.create`
takes nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lockstep.settings import Setting

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: `device.pick_dtype` decides
DTYPE = Setting("dtype", "--dtype", "LOCKSTEP_DTYPE", default="auto",
                help="weights and KV pages: float32, bfloat16 or float16; auto (the default) is float32 on the CPU "
                     "and, on a GPU, the checkpoint's half dtype (bfloat16 for a float32 checkpoint)",
                check=lambda v: "" if v in DTYPES else f"must be one of {', '.join(DTYPES)}, got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    """One rank of a group: the checkpoint, the group it joins and how its KV memory is sized.

    `kv_pages` > 0 fixes the pool; else `kv_budget_bytes`, else `kv_memory_fraction` of the memory left
    after the weights (the device's default when None).
    """

    model: str = "builtin"
    rank: int = 0
    world_size: int = 1
    rendezvous: str = "127.0.0.1:29500"
    page_size: int = 16
    kv_pages: int = 0
    kv_budget_bytes: int = 0
    kv_memory_fraction: float | None = None
    prefix_caching: bool = True
    dtype: str = "auto"
    collective_timeout_s: float = 60.0  # a collective whose peer never comes fails after this: the group is broken

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or self.world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank!r} is outside a group of {self.world_size} ranks")
        if type(self.page_size) is not int or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.kv_pages < 0 or self.kv_budget_bytes < 0:
            raise ValueError("kv_pages and kv_budget_bytes must be >= 0")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not re.fullmatch(r".+:\d+", self.rendezvous):
            raise ValueError(f"rendezvous must be host:port, got {self.rendezvous!r}")
        if not 0 < self.collective_timeout_s <= 86400:
            raise ValueError(f"collective_timeout_s must be in (0, 86400], got {self.collective_timeout_s}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
