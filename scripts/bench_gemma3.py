"""Gemma 3 270M greedy tokens/s on this machine: Lockstep's in-process path next to `transformers`.

Lockstep runs the way `lockstep bench --only in-process` does (`run_in_process`: the real Scheduler driving a
LocalGroup of rank processes, float32, prefix caching on, nothing shared between the random prompts);
`transformers` runs `AutoModelForCausalLM.generate` on the same converted checkpoint, in one process, with
the whole batch left-padded into one tensor. Both get the same random-token prompts (`make_workload`, so
the ids are those `lockstep bench` would draw) and produce exactly --new-tokens tokens per request (no EOS).

For each batch size B the workload is B requests of --prompt-len tokens, all in flight at once, so "batch
16" is 16 prefills then decode steps of 16. Reported per row:

- tok/s: output tokens / wall time from submitting the batch to the last token (prefill included);
- decode tok/s: B / the median time of one decode step (Lockstep: the step times of the second half of the
  run; transformers: (generate(N) - generate(1)) / (N - 1));
- same as HF fp32: how many requests gave the same greedy tokens as transformers in float32.

    python scripts/bench_gemma3.py [--model builtin:gemma3-270m] [--batches 1,16] [--tp 1,2]
                                   [--hf-dtypes float32,bfloat16] [--prompt-len 64] [--new-tokens 64]

`--model builtin:gemma3-270m` is fetched and imported on first use (set LOCKSTEP_CACHE_DIR to reuse a cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from lockstep.bench.command import _model_dir, _model_limits
from lockstep.bench.in_process import run_in_process
from lockstep.bench.report import summarize
from lockstep.bench.workload import BenchConfig, Workload, make_workload


def lockstep_row(model_dir: Path, workload: Workload, tp: int, kv_pages: int) -> dict:
    cfg = BenchConfig(tp=tp, kv_pages=kv_pages, max_num_seqs=max(64, workload.concurrency), warmup=2)
    start = time.perf_counter()
    raw = run_in_process(model_dir, workload, cfg)
    total = time.perf_counter() - start
    s = summarize(raw, workload)
    if s["completed"] != s["requests"]:
        raise RuntimeError(f"Lockstep TP {tp}: {s['completed']}/{s['requests']} completed: {s['errors']}")
    tail = raw.step_s[len(raw.step_s) // 2:]
    return {"side": f"lockstep TP {tp} (float32)", "tok_s": s["throughput_tok_s"], "wall_s": s["wall_s"],
            "decode_tok_s": workload.concurrency / statistics.median(tail), "steps": s["steps"],
            "with_startup_s": total, "first_steps_s": raw.step_s[:4], "outputs": raw.outputs}


def load_hf(model_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def hf_generate(model, prompts: tuple[tuple[int, ...], ...], n: int, pad: int) -> tuple[list[list[int]], float]:
    """Greedy, exactly n tokens each, the batch left-padded into one tensor; (outputs, seconds)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=pad)
        took = time.perf_counter() - start
    return out[:, width:].tolist(), took


def hf_row(model, dtype: str, workload: Workload, pad: int) -> dict:
    hf_generate(model, tuple(p[:16] for p in workload.prompts[:2]), 4, pad)  # warm-up, as Lockstep's
    _, first = hf_generate(model, workload.prompts, 1, pad)
    outputs, took = hf_generate(model, workload.prompts, workload.max_tokens, pad)
    b, n = len(workload.prompts), workload.max_tokens
    decode = (took - first) / max(1, n - 1)
    return {"side": f"transformers ({dtype})", "tok_s": b * n / took, "wall_s": took,
            "decode_tok_s": b / decode if decode > 0 else float("nan"), "steps": n, "first_token_s": first,
            "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:gemma3-270m")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--tp", default="1", help="comma-separated Lockstep TP sizes ('' for none)")
    p.add_argument("--hf-dtypes", default="float32", help="comma-separated transformers dtypes ('' for none)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-pages", type=int, default=512, help="KV pages per rank (both pools together)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    tps = [int(t) for t in args.tp.split(",") if t]
    dtypes = [d for d in args.hf_dtypes.split(",") if d]

    import torch

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = _model_dir(args.model)
    vocab, _ = _model_limits(model_dir)
    pad = json.loads((model_dir / "config.json").read_text()).get("pad_token_id") or 0
    workloads = {b: make_workload(b, args.prompt_len, args.prompt_len, args.new_tokens, b, vocab, args.seed)
                 for b in batches}

    rows: list[dict] = []
    for tp in tps:
        for b in batches:
            rows.append({"batch": b, **lockstep_row(model_dir, workloads[b], tp, args.kv_pages)})
            print(f"  done: batch {b} {rows[-1]['side']}: {rows[-1]['tok_s']:.1f} tok/s", file=sys.stderr)
    reference: dict[int, list] = {}
    for dtype in dtypes:
        model = load_hf(model_dir, dtype)
        for b in batches:
            rows.append({"batch": b, **hf_row(model, dtype, workloads[b], pad)})
            if dtype == "float32":
                reference[b] = rows[-1]["outputs"]
            print(f"  done: batch {b} {rows[-1]['side']}: {rows[-1]['tok_s']:.1f} tok/s", file=sys.stderr)
        del model

    print(f"Gemma 3 270M ({model_dir}), {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy; "
          f"{threads} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}")
    print(f"{'batch':>5}  {'side':<26}{'tok/s':>9}{'decode tok/s':>14}{'wall s':>9}  same as HF fp32")
    for r in sorted(rows, key=lambda r: r["batch"]):
        ref = reference.get(r["batch"])
        same = "-" if ref is None else f"{sum(a == b for a, b in zip(r['outputs'], ref, strict=True))}/{r['batch']}"
        print(f"{r['batch']:>5}  {r['side']:<26}{r['tok_s']:>9.1f}{r['decode_tok_s']:>14.1f}{r['wall_s']:>9.2f}"
              f"  {same}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "rows": [{k: v for k, v in r.items() if k != "outputs"}
                                                                    for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
