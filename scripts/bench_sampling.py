"""Time `sample()` against the sort-per-row implementation it replaced, on the built-in model's vocabulary.

    python3 scripts/bench_sampling.py [--runs 15] [--threads 2] [--vocab 49152] [--zipf 1.5]

Prints one table: per batch size and mode, the median milliseconds of the old and the new `sample()`
and their ratio; for plain temperature sampling also the exponential (Gumbel) race, the alternative
that was measured and not kept. The logits are synthetic but shaped like a language model's (a few likely tokens over
a long Zipf tail), since top-p's cost depends on how wide the nucleus is; greedy and plain temperature
sampling cost the same whatever the logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from lockstep.model.sampling import sample
from lockstep.steps import SamplingParams

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
}
BATCHES = (1, 8, 32)


# ---- BASELINE: the implementation before the rewrite, copied verbatim (minus check_params) ----------

def old_allowed_mask(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """OLD: full stable sort of the vocabulary per row, then top-k and top-p on the sorted order."""
    v = logits.shape[-1]
    order = torch.sort(logits, descending=True, stable=True).indices
    keep = torch.ones(v, dtype=torch.bool)
    if 0 < p.top_k < v:
        keep[p.top_k:] = False
    if p.top_p < 1:
        sorted_logits = logits[order].masked_fill(~keep, float("-inf"))
        probs = torch.softmax(sorted_logits / p.temperature, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        keep &= before < p.top_p
        keep[0] = True
    mask = torch.zeros(v, dtype=torch.bool)
    mask[order[keep]] = True
    return mask


def old_sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int]) -> list[int]:
    """OLD: a Python loop over rows, each sorted, masked, softmaxed and drawn with torch.multinomial."""
    out = torch.argmax(logits, dim=-1).tolist()
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if not drawn:
        return out
    rows = logits[drawn].float().cpu()
    for row, i in zip(rows, drawn, strict=True):
        p = params[i]
        masked = row.masked_fill(~old_allowed_mask(row, p), float("-inf"))
        probs = torch.softmax(masked / p.temperature, dim=-1)
        gen = torch.Generator(device="cpu").manual_seed(int(seeds[i]) % (1 << 64))
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out

# ---- end of BASELINE -------------------------------------------------------------------------------


def race_sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int]) -> list[int]:
    """ALTERNATIVE, measured and not used: plain temperature sampling by the exponential race (Gumbel-max,
    argmin of log(E) - (x - max) / T with E ~ Exp(1) per token from the row's generator), as first built.
    Plain rows only (no top-k/top-p, no greedy, finite logits)."""
    x = logits.float()
    noise = torch.empty_like(x)
    for r, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed(int(seed) % (1 << 64))
        noise[r].uniform_(generator=gen).clamp_(2.0**-24, 1.0 - 2.0**-24).log_().neg_().log_()
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
    top = torch.amax(x, dim=1, keepdim=True)
    return torch.argmin(torch.addcdiv(noise, x - top, t, value=-1), dim=1).tolist()


def lm_like_logits(batch: int, vocab: int, zipf: float, seed: int = 0) -> torch.Tensor:
    """Rows whose probabilities fall off as rank^-zipf (shuffled over ids, with a little noise): zipf 1.5
    is about 3 nats of entropy and a top-p 0.9 nucleus of ~50 tokens, like a small LM's typical step;
    zipf 1.1 is a flat, uncertain step (6.5 nats, a nucleus of thousands)."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = []
    for _ in range(batch):
        tail = -zipf * torch.log(rank) + 0.1 * torch.randn(vocab, generator=gen)
        rows.append(tail[torch.randperm(vocab, generator=gen)])
    return torch.stack(rows) + 12.0


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--zipf", type=float, default=1.5, help="how fast probabilities fall off with rank")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"vocab {args.vocab}, zipf {args.zipf}, torch {torch.__version__}, {args.threads} threads, "
          f"median of {args.runs} runs")
    print(f"{'batch':>5}  {'mode':<14} {'old ms':>9} {'new ms':>9} {'old/new':>8} {'race ms':>9}")
    for batch in BATCHES:
        logits = lm_like_logits(batch, args.vocab, args.zipf)
        seeds = list(range(1000, 1000 + batch))
        for name, p in MODES.items():
            params = [p] * batch
            old = median_ms(lambda: old_sample(logits, params, seeds), args.runs)  # noqa: B023
            new = median_ms(lambda: sample(logits, params, seeds), args.runs)  # noqa: B023
            race = "-"
            if name == "temperature 1":
                race = f"{median_ms(lambda: race_sample(logits, params, seeds), args.runs):.2f}"  # noqa: B023
            print(f"{batch:>5}  {name:<14} {old:>9.2f} {new:>9.2f} {old / new:>7.1f}x {race:>9}")


if __name__ == "__main__":
    main()
