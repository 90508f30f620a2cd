"""A step's decode masks, built by `attention_batch`'s `_SingleGather.build_all`: where each group of one-token
sequences may look, as views of a block per run of groups, and as 0 / -inf biases in the queries' dtype.

The biases are slices of one cached pattern (`_pattern`): remade each step it cost a few small tensor
operations, and a GPU's copies stay out of the forward only if the engine makes the biases before it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch


class DecodeMasks:
    """A step's decode masks: one [rows, slots] block per run of groups, each group's mask a view of its rows;
    the biases per dtype made a block at a time. One block is as wide as its widest group, so the groups share
    one block only when that wastes little (a long group among short ones gets its own)."""

    def __init__(self, ends: torch.Tensor, at: torch.Tensor, span: tuple[int, int], window: int | None,
                 blocks: list[tuple[int, int, int, list[tuple[int, int, int]]]]) -> None:
        self.ends = ends  # of every row: it sees slots [ends - window, ends) (all before its end without a window)
        self.at, self.span = at, span  # where each row's bias starts in the (reach, band) pattern (`_pattern`)
        self.window = window
        self.blocks = blocks  # (first row, rows, slots wide, (group, rows, slots) of each group, in row order)
        self._biases: dict[torch.dtype, dict[int, torch.Tensor]] = {}

    @cached_property
    def masks(self) -> dict[int, torch.Tensor]:
        """Each group's [rows, 1, 1, slots] boolean view, by group: made on first use (the layers read biases)."""
        return self._split_all(self._mask)

    def _mask(self, a: int, k: int, width: int) -> torch.Tensor:
        slot = torch.arange(width, device=self.ends.device)
        seen = slot < self.ends[a:a + k].unsqueeze(1)
        if self.window is not None:
            seen &= slot >= self.ends[a:a + k].unsqueeze(1) - self.window
        return seen

    @classmethod
    def build(cls, ends: torch.Tensor, at: torch.Tensor, span: tuple[int, int], groups: list[tuple[int, int]],
              window: int | None) -> DecodeMasks | None:
        """Row r sees slots [ends[r] - window, ends[r]) (without a window, all before its end), slots counted as
        `build_all` counts them; at, span: where each row's bias starts in the pattern of `pattern_span`.
        groups: (rows, slots) each, 0 slots for one needing no mask."""
        width = max(h for _, h in groups)
        if not width:
            return None
        if sum(k for k, _ in groups) * width <= 2 * sum(k * h for k, h in groups) + (1 << 16):
            return cls(ends, at, span, window, [(0, len(ends), width, [(g, k, h) for g, (k, h) in enumerate(groups)])])
        blocks, a = [], 0
        for g, (k, h) in enumerate(groups):
            if h:
                blocks.append((a, k, h, [(g, k, h)]))
            a += k
        return cls(ends, at, span, window, blocks)

    def _bias_rows(self, dtype: torch.dtype) -> Callable[[int, int, int], torch.Tensor]:
        """Rows [a, a + k) of a block `width` slots wide, 0 where a row sees the slot and -inf elsewhere: each row
        is a slice of one pattern (`_pattern`) starting where its end puts the pattern's edge, so a block is one
        gather off the pattern's overlapping slices (`unfold`), made in `dtype`. Arithmetic on slot numbers took
        2.4x the time in float32, 7x in float16 and 7-40x with a window."""
        pattern, at = _pattern(dtype, self.ends.device, *self.span), self.at
        return lambda a, k, width: pattern.unfold(0, width, 1).index_select(0, at[a:a + k])

    def _split_all(self, made: Callable[[int, int, int], torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each group's [rows, 1, 1, slots] view of `made(first row, rows, width)` of its block, by group (the
        strides `[:, None, None, :slots]` of its rows gives; `as_strided` costs a fraction of split and index)."""
        out = {}
        for a, k, width, groups in self.blocks:
            block = made(a, k, width)
            at = block.storage_offset()
            for g, n, h in groups:
                out[g] = block.as_strided((n, 1, 1, h), (width, width, width, 1), at)
                at += n * width
        return out

    def bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The group's mask as 0 / -inf in `dtype`, so SDPA does not convert it again on every layer."""
        made = self._biases.get(dtype)
        if made is None:
            made = self._biases[dtype] = self._split_all(self._bias_rows(dtype))
        return made[group]


def pattern_span(reach: int, window: int | None) -> tuple[int, int]:
    """(reach, band) of the `_pattern` for rows ending at most at `reach`: the reach rounded up to a power of
    two so one pattern serves many steps, and a band as wide as it where the window hides no slot. Row r's bias
    starts at reach + band - ends[r]: slot s is 0 iff ends[r] - band <= s < ends[r]."""
    reach = 1 << max(6, (reach - 1).bit_length())
    return reach, reach if window is None else min(window, reach)


def _pattern(dtype: torch.dtype, device: torch.device, reach: int, band: int) -> torch.Tensor:
    """-inf, `band` 0s, -inf (reach before and after), made once per dtype and size: remade each step it cost
    three small tensor operations (one a kernel on a GPU). Never written once made."""
    key = (dtype, device, reach, band)
    pattern = _PATTERNS.get(key)
    if pattern is None:
        if len(_PATTERNS) >= 64:  # a few per pool and dtype are in use at once; reaches only grow
            _PATTERNS.clear()
        pattern = _PATTERNS[key] = torch.full((2 * reach + band,), _NEG_INF, dtype=dtype, device=device)
        pattern[reach:reach + band] = 0
    return pattern


_PATTERNS: dict[tuple[torch.dtype, torch.device, int, int], torch.Tensor] = {}
_NEG_INF = float("-inf")
