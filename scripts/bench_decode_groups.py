"""What one decode attention call costs on this device, in gathered key slots: the number behind
`device.attention_call_tokens` (how `AttentionBatch` weighs a group's padding against one more call), measured.

    python scripts/bench_decode_groups.py --batch 256 --layers 4

- fit: one group of k rows of w pages each, attention timed over a grid of (k, w); the least-squares line
  t = a + b * slots (slots = k * w * page_size gathered) gives a call's fixed cost a and one slot's cost b, and
  a / b is the call's cost in slots.
- sweep: a decode batch of mixed lengths (--min-len..--max-len, as the control plane benchmark's) grouped with
  each call cost in turn; per step, the host's inputs (batch and groups) and `--layers` layers of decode
  attention, so the device's own constant can be checked against its neighbours.

Runs on the device a rank would pick (`lockstep.device`; LOCKSTEP_DEVICE=cpu forces the CPU), in the dtype of
`--dtype`, with torch on `--threads` threads on the CPU. The shapes default to the built-in model's
(9 query heads, 3 KV heads of 64); an 8B model's are `--heads 32 --kv-heads 8 --head-dim 128`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from lockstep.device import attention_call_tokens, pick_device
from lockstep.model import attention_batch
from lockstep.model.attention import paged_attention
from lockstep.model.attention_batch import AttentionBatch


def _timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Median seconds of `fn` over `repeat` calls, each waited for on the device."""
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    wait()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Setup:
    """A KV cache and a block table holding `lengths` (one row each, pages in random order), and queries."""

    def __init__(self, lengths: list[int], args: argparse.Namespace, device: torch.device) -> None:
        ps = args.page_size
        self.lengths, self.page_size, self.device = lengths, ps, device
        need = [-(-(n + 1) // ps) for n in lengths]
        pages = sum(need) + 1
        order = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(0)).add(1).tolist()
        self.table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
        at = 0
        for i, n in enumerate(need):
            self.table[i, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
            at += n
        dtype = getattr(torch, args.dtype)
        shape = (pages, ps, args.kv_heads, args.head_dim)
        self.k = torch.randn(shape, device=device).to(dtype)
        self.v = torch.randn(shape, device=device).to(dtype)
        self.q = torch.randn(len(lengths), args.heads, args.head_dim, device=device).to(dtype)
        self.scale = args.head_dim ** -0.5

    def batch(self) -> AttentionBatch:
        """The step's inputs, as the engine builds them: the batch off the table and its decode groups."""
        batch = AttentionBatch.from_table(self.table, range(len(self.lengths)), self.lengths, [1] * len(self.lengths),
                                          self.page_size, self.device)
        batch.single_gathers(None)
        return batch

    def attend(self, batch: AttentionBatch) -> torch.Tensor:
        """One layer's decode attention over the batch."""
        return paged_attention(self.q, self.k, self.v, batch, None, self.scale)

    def step(self, layers: int) -> None:
        """One decode step's attention: the host's inputs, then every layer's attention over them."""
        batch = self.batch()
        for _ in range(layers):
            self.attend(batch)


def fit(args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """(a call's fixed seconds, one gathered slot's seconds) from one-group batches over a grid of shapes, each
    layer's attention timed on inputs built once (as every layer after the first reads them)."""
    attention_batch.GROUP_CALL_TOKENS = 1 << 40  # every row in one group: one call per layer
    points = []
    for rows in args.fit_rows:
        for pages in args.fit_pages:
            setup = Setup([pages * args.page_size - 1] * rows, args, device)
            batch = setup.batch()
            seconds = _timed(lambda s=setup, b=batch: s.attend(b), device, args.repeat)
            points.append((rows * pages * args.page_size, seconds))
            print(f"  one call, {rows:>4} rows x {pages:>4} pages: {seconds * 1e6:10.1f} us")
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def sweep(args: argparse.Namespace, device: torch.device) -> list[tuple[int, int, float]]:
    """(call cost, groups, ms per step) for each call cost on one batch of mixed lengths."""
    rng = random.Random(args.seed)
    setup = Setup([rng.randint(args.min_len, args.max_len) for _ in range(args.batch)], args, device)
    rows = []
    for tokens in args.call_tokens:
        attention_batch.GROUP_CALL_TOKENS = tokens
        groups = len(setup.batch().single_gathers(None))
        rows.append((tokens, groups, _timed(lambda: setup.step(args.layers), device, args.repeat) * 1e3))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="attention layers per step (the inputs are built once)")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="", help="float32, bfloat16, ... (default: float32 on the CPU, else bfloat16)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (default: torch's own)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit-rows", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--fit-pages", type=int, nargs="+", default=[2, 8, 32, 75])
    p.add_argument("--call-tokens", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384, 65536])
    args = p.parse_args()
    device = pick_device(0)
    args.dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"decode attention on {device} ({args.dtype}, {torch.get_num_threads()} threads), heads {args.heads}/"
          f"{args.kv_heads} x {args.head_dim}, page size {args.page_size}")
    with torch.inference_mode():
        call_s, slot_s = fit(args, device)
        unresolved = "not resolved (the line's intercept is lost in the slots' cost: see the sweep)"
        cost = f"{call_s / slot_s:.0f} slots" if call_s > 0 < slot_s else unresolved
        print(f"fit: a call {call_s * 1e6:.1f} us + {slot_s * 1e9:.3f} ns a gathered slot: one call costs {cost} "
              f"(this device's constant: {attention_call_tokens(device)})")
        print(f"sweep: batch {args.batch}, lengths {args.min_len}-{args.max_len}, {args.layers} layers a step")
        print(f"{'call tokens':>12}{'groups':>8}{'ms/step':>10}")
        rows = sweep(args, device)
        for tokens, groups, ms in rows:
            print(f"{tokens:>12}{groups:>8}{ms:>10.3f}")
        print(f"fastest: call tokens {min(rows, key=lambda r: r[2])[0]} (this device's constant: "
              f"{attention_call_tokens(device)})")


if __name__ == "__main__":
    main()
