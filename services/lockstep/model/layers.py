"""Tensor-parallel building blocks of a Llama-family decoder.

Each parallel layer holds only this rank's shard and records, per checkpoint tensor it is made of, which
rows or columns of that tensor the shard is, so the loader can read exactly those and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.model.config import RopeScaling
from lockstep.parallel.comm import Comm

# Up to this many rows (a decode batch) the LM head runs as W x^T on the CPU; see `small_batch_linear`.
SMALL_BATCH_ROWS = 64


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T for x of [rows, in], computed as (W x^T)^T for a decode-sized batch on the CPU.

    With MKL at 2 threads, F.linear's x W^T for 2..64 rows runs far below the same product as W x^T
    (SmolLM2's LM head: 2 rows 25 ms against 4 ms, 32 rows 25 against 20). One row is the same GEMV
    either way (bit-identical), and larger inputs are faster as F.linear, so both keep it. Every linear
    layer uses it (1.2-1.5x on the decode GEMMs): a row's result then depends on how many rows share the
    step by float rounding only (~1e-6 relative), as it does with F.linear's own kernels.
    """
    if x.device.type != "cpu" or x.dim() != 2 or not 1 < x.shape[0] <= SMALL_BATCH_ROWS:
        return F.linear(x, weight)
    return torch.mm(weight, x.t()).t().contiguous()


def rank_slice(size: int, comm: Comm, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of a dimension that is split over the ranks."""
    if size % comm.world_size:
        raise ValueError(f"{what} {size} does not split over {comm.world_size} ranks")
    length = size // comm.world_size
    return comm.rank * length, length


@dataclass(frozen=True)
class Part:
    """Rows [start, start + length) of a checkpoint tensor of `total` rows, at `offset` in the shard."""

    total: int
    start: int
    length: int
    offset: int


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over ranks; several checkpoint tensors may be fused (q/k/v).

    `parts` gives, per fused tensor, its total rows and the (start, length) this rank holds.
    """

    def __init__(self, in_features: int, parts: Sequence[tuple[int, int, int]], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts: list[Part] = []
        offset = 0
        for total, start, length in parts:
            self.parts.append(Part(total, start, length, offset))
            offset += length
        self.out_features = offset
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None

    def split_sizes(self) -> list[int]:
        return [p.length for p in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = small_batch_linear(x, self.weight)
        return y + self.bias if self.bias is not None else y


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced, bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.in_total = in_features
        self.in_start, self.in_local = rank_slice(in_features, comm, "input width")
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(small_batch_linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous vocabulary range; ids outside it contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_local = rank_slice(vocab_size, comm, "vocabulary")
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary range, all-gathered so every rank holds the full-vocab logits.

    Sampling then runs on identical numbers on every rank, which is what lets each rank draw the token
    itself instead of waiting for a broadcast.
    """

    def __init__(self, vocab_size: int, hidden_size: int, comm: Comm,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_local = rank_slice(vocab_size, comm, "vocabulary")
        self.tied = tied is not None
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(small_batch_linear(x, self.weight), dim=-1)


class RMSNorm(nn.Module):
    """Normalised in fp32 and cast back before the weight, exactly as transformers' Llama does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's norm, x / rms(x) * (1 + weight), all in fp32 and cast back last (transformers' Gemma3RMSNorm):
    checkpoints store the weight as an offset from 1, so a zero weight is the identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate's activation by its transformers name: SwiGLU's silu, or GeGLU's tanh-approximated gelu."""
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return partial(F.gelu, approximate="tanh")
    raise ValueError(f"activation {name!r} is not supported")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies of RoPE, with linear or llama3 (frequency-band) scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for a batch's flattened positions, computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        # Not a buffer: casting the model to bf16 must not round the frequencies.
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]. The half-rotation layout of Hugging Face Llama."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
