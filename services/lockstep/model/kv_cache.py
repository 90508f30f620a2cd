"""This rank's paged KV memory: one k and one v tensor per layer, preallocated once.

Pages are numbered; which page holds which tokens of which request is the allocator's business (kv/),
the model only reads and writes the slots an `AttentionBatch` names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.model.config import ModelConfig
from lockstep.parallel.sharding import check_tp_size, local_kv_heads


@dataclass
class KVCache:
    """k[layer] and v[layer]: [num_pages, page_size, kv_heads, head_dim] each."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int

    @staticmethod
    def bytes_per_page(config: ModelConfig, tp: int, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page takes on one rank, k and v of every layer together."""
        check_tp_size(config, tp)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * page_size * local_kv_heads(config, tp) * config.head_dim * elem

    @classmethod
    def pages_for_budget(
        cls, config: ModelConfig, tp: int, page_size: int, budget_bytes: int, dtype: torch.dtype
    ) -> int:
        """How many pages fit in `budget_bytes` of this rank's memory."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if budget_bytes < 0:
            raise ValueError(f"KV budget must be non-negative, got {budget_bytes} bytes")
        return budget_bytes // cls.bytes_per_page(config, tp, page_size, dtype)

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        tp: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        if num_pages < 1:
            raise ValueError(f"a KV cache needs at least one page, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        check_tp_size(config, tp)
        shape = (num_pages, page_size, local_kv_heads(config, tp), config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k, v, page_size)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]

    @property
    def num_layers(self) -> int:
        return len(self.k)
