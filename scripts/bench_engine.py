"""Decode tokens/s of the in-process engine next to transformers' `generate`, on the same weights.

Both run greedy, on the same device (`--device`, default the one a rank would pick: `lockstep.device`), in the
same dtype (`--dtype`, default float32), with the same thread count and the same prompts. Only decode
is timed, directly, on both: from the moment the first token (the prefill's) is out to the moment
the N-th is, so N - 1 decode steps in which every sequence gets one token (for the engine, one plan
per step, as the coordinator sends them; for transformers, a stopping criterion that only reads
the clock). Batches above one use prompts of mixed lengths (left padding and an attention mask for
transformers), which is where a padded batch pays for its padding and a paged one does not.

    LOCKSTEP_CACHE_DIR=/tmp/lockstep-test-builtin/cache python scripts/bench_engine.py --batch 1 8 32

On a GPU both sides synchronize once per token (the engine reads its sampled ids, `generate` its stopping
check), so the per-step clocks read finished work there too. `--json FILE` writes the table's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from lockstep.device import DEVICE_ENV, pick_device
from lockstep.engine import Engine
from lockstep.engine_config import EngineConfig
from lockstep.model.builtin import resolve_model
from lockstep.steps import Admit, Chunk, Plan

PAGE_SIZE = 16


@dataclass(frozen=True)
class Decode:
    """One generate call: its greedy tokens and how long each of its decode steps took."""

    tokens: list[list[int]]
    step_s: list[float]

    def tok_s(self) -> float:
        """Tokens/s of the median step: the cores are shared, and a median shrugs off a neighbour's burst."""
        return len(self.tokens) / statistics.median(self.step_s)

    def mean_tok_s(self) -> float:
        return len(self.tokens) * len(self.step_s) / sum(self.step_s)


@dataclass(frozen=True)
class Result:
    batch: int
    prompt_lens: list[int]
    ours: Decode
    hf: Decode


def make_prompts(batch: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids of lengths uniform in [lo, hi]; a fixed seed, so every run sees the same ones."""
    g = torch.Generator().manual_seed(seed + batch)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


class EngineRunner:
    """Drives one Engine with plans the way the coordinator does: admit + prefill, then a decode step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step = 0
        self.run = 0

    def _send(self, plan_kwargs: dict):
        report = self.engine.step(Plan(step=self.step, **plan_kwargs))
        self.step += 1
        if report.error:
            raise RuntimeError(f"the engine refused step {report.step}: {report.error}")
        return report

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Decode:
        """Greedy tokens per prompt, and the seconds each decode step (all but the first token) took."""
        self.run += 1
        ids = [f"r{self.run}-{i}" for i in range(len(prompts))]
        report = self._send({
            "admits": tuple(Admit(r) for r in ids),
            "batch": tuple(Chunk(r, tuple(p), 0, sample=True) for r, p in zip(ids, prompts, strict=True)),
        })
        out = {s.request_id: [s.token_id] for s in report.sampled}
        lengths = {r: len(p) for r, p in zip(ids, prompts, strict=True)}
        times = [time.perf_counter()]
        for i in range(1, new_tokens):
            batch = tuple(Chunk(r, (out[r][-1],), lengths[r] + i - 1, sample=True, sample_index=i)
                          for r in ids)
            for s in self._send({"batch": batch}).sampled:
                out[s.request_id].append(s.token_id)
            times.append(time.perf_counter())
        self._send({"releases": tuple(ids)})
        return Decode([out[r] for r in ids], [b - a for a, b in pairwise(times)])


class _TokenClock(StoppingCriteria):
    """Never stops generation; notes the time each new token is ready, so decode is timed directly."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Decode:
    """Greedy tokens per prompt from `generate` (left-padded), and the seconds of each of its decode steps."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    clock = _TokenClock()
    with torch.inference_mode():
        # No EOS: our engine does not stop at it either, and min_new_tokens would mask it out of the argmax.
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=pad_id,
                             stopping_criteria=StoppingCriteriaList([clock]))
    if len(clock.times) != new_tokens:
        raise RuntimeError(f"transformers gave {len(clock.times)} token times for {new_tokens} new tokens")
    return Decode(out[:, width:].tolist(), [b - a for a, b in pairwise(clock.times)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin", help="HF checkpoint directory, or 'builtin'")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="", help="cpu, cuda or cuda:N (default: what a rank picks, lockstep.device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch):
        p.error(f"--batch sizes must be >= 1, got {args.batch}")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be >= 2 (decode is timed after the first token), got {args.new_tokens}")
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error(f"need 1 <= --min-prompt <= --max-prompt, got {args.min_prompt} and {args.max_prompt}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device:
        os.environ[DEVICE_ENV] = args.device  # the engine takes its device where every rank does
    device = pick_device()
    model_dir = Path(resolve_model(args.model))
    max_len = args.max_prompt + args.new_tokens
    pages = max(args.batch) * -(-max_len // PAGE_SIZE) + 1
    engine = Engine.create(EngineConfig(str(model_dir), page_size=PAGE_SIZE, kv_pages=pages, dtype=args.dtype))
    ours = EngineRunner(engine)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    pad_id = hf.generation_config.pad_token_id
    if pad_id is None:
        pad_id = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0
    vocab = engine.config.vocab_size

    warm = make_prompts(2, 8, 24, vocab, seed=10_000)
    ours.generate(warm, 3)
    hf_generate(hf, warm, 3, pad_id)

    results: list[Result] = []
    for b in args.batch:
        prompts = make_prompts(b, args.min_prompt, args.max_prompt, vocab, args.seed)
        ours_run = ours.generate(prompts, args.new_tokens)
        hf_run = hf_generate(hf, prompts, args.new_tokens, pad_id)
        results.append(Result(b, [len(p) for p in prompts], ours_run, hf_run))
    print_table(results, args, model_dir.name, device)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": model_dir.name, "device": str(device), "dtype": args.dtype, "new_tokens": args.new_tokens,
            "results": [{"batch": r.batch, "ours_tok_s": r.ours.tok_s(), "hf_tok_s": r.hf.tok_s(),
                         "ours_mean_tok_s": r.ours.mean_tok_s(), "hf_mean_tok_s": r.hf.mean_tok_s(),
                         "greedy_same": sum(a == h for a, h in zip(r.ours.tokens, r.hf.tokens, strict=True))}
                        for r in results]}, indent=1))
    for r in results:
        if r.batch == 1 and args.dtype == "float32":  # in half precision two correct kernels may round apart
            if r.ours.tokens != r.hf.tokens:
                print(f"FAIL: batch 1 greedy tokens differ from transformers':\n"
                      f"  ours {r.ours.tokens[0]}\n  hf   {r.hf.tokens[0]}")
                return 1
            print(f"sanity: batch 1 greedy tokens agree with transformers ({len(r.ours.tokens[0])} tokens)")
    return 0


def print_table(results: list[Result], args: argparse.Namespace, model_name: str, device: torch.device) -> None:
    print(f"model {model_name}, {args.dtype} {device}, {args.threads} threads, TP 1, {args.new_tokens} new tokens "
          f"({args.new_tokens - 1} decode steps), prompts uniform {args.min_prompt}..{args.max_prompt} "
          f"(seed {args.seed})")
    print("decode tok/s from the median step; 'mean' columns from the whole decode time")
    print(f"{'batch':>5}  {'prompt lengths':<28} {'ours':>8} {'hf':>8} {'ratio':>6}  "
          f"{'ours mean':>9} {'hf mean':>8} {'ratio':>6}  greedy same")
    for r in results:
        lens = ",".join(map(str, r.prompt_lens))
        if len(lens) > 28:
            lens = f"{min(r.prompt_lens)}..{max(r.prompt_lens)} mean {sum(r.prompt_lens) // r.batch}"
        same = sum(a == h for a, h in zip(r.ours.tokens, r.hf.tokens, strict=True))
        print(f"{r.batch:>5}  {lens:<28} {r.ours.tok_s():>8.1f} {r.hf.tok_s():>8.1f} "
              f"{r.ours.tok_s() / r.hf.tok_s():>6.2f}  {r.ours.mean_tok_s():>9.1f} {r.hf.mean_tok_s():>8.1f} "
              f"{r.ours.mean_tok_s() / r.hf.mean_tok_s():>6.2f}  {same}/{r.batch}")

if __name__ == "__main__":
    sys.exit(main())
