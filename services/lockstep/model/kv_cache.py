"""This rank's paged KV memory: one k and one v tensor per layer, preallocated once.

Pages are numbered per pool: a layer's tensors have as many pages as the pool of its attention kind
(`ModelConfig.pool_of`), so a sliding layer's page 3 and a full layer's page 3 are different pages. Which
page holds which tokens of which request is the allocator's business (kv/); the model only reads and
writes the slots an `AttentionBatch` of that pool names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lockstep.kv.paging import POOL_FULL, POOL_SLIDING, pages_for, peak_pages
from lockstep.model.config import ModelConfig
from lockstep.parallel.sharding import check_tp_size, local_kv_heads


@dataclass
class KVCache:
    """k[layer] and v[layer]: [num_pages, page_size, kv_heads, head_dim] each."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int

    @staticmethod
    def bytes_per_page(
        config: ModelConfig, tp: int, page_size: int, dtype: torch.dtype, pool: str | None = None
    ) -> int:
        """Bytes one page of `pool` takes on one rank, k and v of every layer of that pool together (of every
        layer when `pool` is None: a page of every pool)."""
        check_tp_size(config, tp)
        elem = torch.empty((), dtype=dtype).element_size()
        layers = config.num_layers if pool is None else config.layers_of(pool)
        return 2 * layers * page_size * local_kv_heads(config, tp) * config.head_dim * elem

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
    def split_budget(
        cls, config: ModelConfig, tp: int, page_size: int, budget_bytes: int, dtype: torch.dtype
    ) -> dict[str, int]:
        """Pages of each pool that fit in `budget_bytes` together.

        With a sliding pool the split is sized so that both pools run out together on requests of a
        typical context, min(max_model_len, 4 * window) tokens: each holds all of it in `full` and its
        window and one page more in `sliding`. The workload decides the best split; this is where it starts.
        """
        pools = config.pool_names
        if len(pools) == 1:
            return {pools[0]: cls.pages_for_budget(config, tp, page_size, budget_bytes, dtype)}
        window = config.sliding_window or 0
        context = min(config.max_position_embeddings, 4 * window)
        per_request = {POOL_FULL: pages_for(context, page_size),
                       POOL_SLIDING: peak_pages(window, page_size, context)}
        cost = {p: cls.bytes_per_page(config, tp, page_size, dtype, p) for p in pools}
        requests = budget_bytes / sum(per_request[p] * cost[p] for p in pools)
        full = int(requests * per_request[POOL_FULL])
        return {POOL_FULL: full, POOL_SLIDING: (budget_bytes - full * cost[POOL_FULL]) // cost[POOL_SLIDING]}

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        tp: int,
        num_pages: int | Mapping[str, int],
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """`num_pages` per pool (one int: the same for every pool)."""
        pools = config.pool_names
        pages = {p: num_pages for p in pools} if isinstance(num_pages, int) else dict(num_pages)
        if sorted(pages) != sorted(pools):
            raise ValueError(f"pages are given for pools {sorted(pages)} but the model has pools {list(pools)}")
        for pool, n in pages.items():
            if n < 1:
                raise ValueError(f"a KV pool needs at least one page, got {n} for {pool!r}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        check_tp_size(config, tp)
        heads = local_kv_heads(config, tp)

        def zeros(layer: int) -> torch.Tensor:
            shape = (pages[config.pool_of(layer)], page_size, heads, config.head_dim)
            return torch.zeros(shape, dtype=dtype, device=device)

        k = [zeros(i) for i in range(config.num_layers)]
        v = [zeros(i) for i in range(config.num_layers)]
        return cls(k, v, page_size)

    def resize(self, config: ModelConfig, pages: Mapping[str, int]) -> None:
        """Give each pool's layers their new page count (a rebalance the group agreed on), keeping the pages
        below it: the bookkeeping moved no page a live request holds, so the pages kept are all it reads."""
        for layer in range(self.num_layers):
            n = pages.get(config.pool_of(layer))
            if n is None or n == self.k[layer].shape[0]:
                continue
            for tensors in (self.k, self.v):
                old = tensors[layer]
                new = old.new_zeros((n, *old.shape[1:]))
                keep = min(n, old.shape[0])
                new[:keep] = old[:keep]
                tensors[layer] = new

    @property
    def num_pages(self) -> int:
        """Pages of layer 0's pool."""
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
