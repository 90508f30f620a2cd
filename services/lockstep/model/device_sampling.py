"""Seeded draws where the logits live (a GPU), without copying them to the host.

`sampling.py` draws on the CPU: one uniform number per row and the row's CDF, a float64 running sum per
token. For logits on a GPU that means copying every drawing row to the host and summing it there: at batch
256 over a 128k vocabulary, 128 MB and on the order of 100 ms per step, several times a decode forward. Here
the draw stays on the device, batched over rows: the exponential race (Gumbel-max), the argmax of
(logit - max) / T + G with G = -log(-log(u)), which picks token i with probability softmax((logit - max) / T)_i.

Each u comes from a counter-based hash of (the row's seed, the token id) in 64-bit integer arithmetic, the
same on any device, with 53 random bits (so the far tail is not biased, as 24-bit uniforms would bias it).
A row's token therefore depends only on its logits, its parameters and its seed: not on its neighbours in
the batch, the device's generator or the thread count, and a recompute or a replay draws it again. It is not
the CPU path's token for the same seed (a different method); a deployment runs on one kind of device.

Top-k and top-p mask a row before the race from one stable sort of it (ties by token id, as on the CPU):
top-k keeps the k most likely, top-p the smallest prefix of those whose share of their total weight reaches
top_p (at least one token), the CPU path's very definition.
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 23  # 64 MB per float64 temporary: 64 rows of a 128k vocabulary at a time
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's increment and multipliers, as signed 64-bit integers
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _signed64(seed: int) -> int:
    """The seed's low 64 bits, as the int64 that holds them (seeds derived by hashing may be wider)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic: it would copy the sign bit in)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer; int64 multiplication wraps around alike on the CPU and on CUDA."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64 numbers in (0, 1), u[r, i] a function of (seeds[r], i) alone: splitmix64's
    output for counter i + 1 of the stream that the row's seed starts, its top 53 bits, centred in its cell."""
    ids = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device)
    z = _mix(seeds.to(torch.int64).unsqueeze(1) + ids * _GOLDEN)
    return (_shr(z, 11).to(torch.float64) + 0.5) * 2.0 ** -53


def _masked(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The scaled rows with every token outside top-k, then outside the nucleus of top_p, at -inf. top_k 0
    and top_p 1 are off; the rows come with their maximum at 0 (so the weights exp(.) are at most 1)."""
    ordered, ids = torch.sort(scaled, dim=1, descending=True, stable=True)
    position = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    keep = (top_k.unsqueeze(1) == 0) | (position < top_k.unsqueeze(1))
    weights = torch.where(keep, ordered.exp(), 0.0).to(torch.float64)
    running = torch.cumsum(weights, dim=1)
    before = running - weights  # the weight of the tokens ahead of each one
    need = top_p.to(torch.float64).unsqueeze(1) * running[:, -1:]
    keep &= (before < need) | (position == 0)
    return torch.full_like(scaled, float("-inf")).scatter_(1, ids, torch.where(keep, ordered, float("-inf")))


def race_draw(x: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
              seeds: list[int]) -> list[int]:
    """One token per row of `x` ([rows, vocab], on any device), for normalized parameters (temperature > 0;
    top_k 0 or in (1, vocab); top_p in (0, 1], 1 off): the argmax of the scaled row, masked by top-k / top-p,
    plus the row's Gumbel noise; -1 for a row with no finite maximum (NaN, +inf, nothing finite), which the
    caller answers otherwise. One copy to the host for the whole batch. Rows go in blocks of at most
    BLOCK_ELEMENTS values, so the float64 temporaries stay small next to the KV pool's share of the device."""
    step = max(1, BLOCK_ELEMENTS // max(1, x.shape[1]))
    blocks = [_race_block(x[a:a + step], temperatures[a:a + step], top_ks[a:a + step], top_ps[a:a + step],
                          seeds[a:a + step]) for a in range(0, x.shape[0], step)]
    return torch.cat(blocks).tolist()


def _race_block(x: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                seeds: list[int]) -> torch.Tensor:
    device = x.device
    x = x.to(torch.float32)
    t = torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1)
    top = torch.amax(x, dim=1, keepdim=True)  # NaN or infinite in the rows the caller answers otherwise
    scaled = (x - top) / t
    filtered = [j for j, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)) if k > 0 or p < 1]
    if filtered:
        rows = torch.tensor(filtered, device=device)
        scaled[rows] = _masked(scaled[rows], torch.tensor([top_ks[j] for j in filtered], device=device),
                               torch.tensor([top_ps[j] for j in filtered], device=device))
    seed = torch.tensor([_signed64(s) for s in seeds], dtype=torch.int64, device=device)
    gumbel = -torch.log(-torch.log(uniforms(seed, x.shape[1])))
    tokens = torch.argmax(scaled.to(torch.float64) + gumbel, dim=1)
    return torch.where(torch.isfinite(top.squeeze(1)), tokens, -1)
