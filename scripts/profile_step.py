"""Where one decode step's time goes at batch B (TP 1, fp32, CPU), next to the machine's limits for it.

The step is the engine's real one (a plan in, a report out: bookkeeping, the forward, sampling), driven the
way the coordinator drives it. Its parts are timed by wrapping the functions that do them (the linear layers'
GEMMs, paged attention and its KV writes, norms, RoPE, the embedding, the LM head, building the attention
batch, sampling, the rank's page bookkeeping); what is left is Python and the small element-wise ops between
them. A torch.profiler pass lists the top operators by their own time.

The limits: a decode step must read every weight once (weights' bytes / the read bandwidth measured here), and
must do 2 x params x B FLOPs in its GEMMs (/ the GEMM rate measured here, both at the model's own shapes and
at a large square one). The remaining gap to the measured step is then explained, not guessed.

    LOCKSTEP_CACHE_DIR=/tmp/lockstep-test-builtin/cache python scripts/profile_step.py --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import PAGE_SIZE, make_prompts  # noqa: E402

import lockstep.engine as engine_module  # noqa: E402
import lockstep.model.llama as llama_module  # noqa: E402
from lockstep.engine import Engine  # noqa: E402
from lockstep.engine_config import EngineConfig  # noqa: E402
from lockstep.kv.rank_cache import RankCache  # noqa: E402
from lockstep.model import layers  # noqa: E402
from lockstep.model.attention import AttentionBatch  # noqa: E402
from lockstep.model.builtin import resolve_model  # noqa: E402
from lockstep.steps import Admit, Chunk, Plan, SamplingParams  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)  # every wrapped call's time
BUILT: list[AttentionBatch] = []  # the last attention batch built, to show how decode attention grouped it
PARTS: dict[str, float] = defaultdict(float)  # of it, what the timed decode steps spent


def _timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0
    return wrapper


def _recorded(build: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        BUILT[:] = [build(*args, **kwargs)]
        return BUILT[0]
    return wrapper


def attention_layout(batch: AttentionBatch) -> str:
    """How a full-attention layer serves the batch's decode rows: SDPA calls, and pages gathered (padding
    included) against the pages the rows' keys fill: the two costs its grouping by KV length trades."""
    groups = batch.single_gathers(None)
    gathered = sum(g.pages.numel() for g in groups)
    needed = sum(-(-(batch.starts[i] + 1) // batch.page_size) for i in batch.single_seqs)
    return (f"decode attention per full layer: {len(groups)} SDPA call(s) over {len(batch.single_seqs)} rows, "
            f"{gathered} pages gathered for {needed} holding keys")


def instrument() -> None:
    """Wrap each part of the step in a timer (the parts do not nest, so their times add up)."""
    for cls, name in ((layers.ColumnParallelLinear, "GEMM: qkv / gate-up"), (layers.RowParallelLinear,
                      "GEMM: o / down"), (layers.ParallelLMHead, "GEMM: LM head"), (layers.RMSNorm, "RMSNorm"),
                      (layers.RotaryEmbedding, "RoPE"), (layers.VocabParallelEmbedding, "embedding")):
        cls.forward = _timed(name, cls.forward)
    llama_module.paged_attention = _timed("attention (paged, gathers incl.)", llama_module.paged_attention)
    llama_module.write_kv = _timed("KV writes", llama_module.write_kv)
    AttentionBatch.from_table = staticmethod(_timed("attention batch build", _recorded(AttentionBatch.from_table)))
    engine_module.sample = _timed("sampling", engine_module.sample)
    RankCache.prepare = _timed("page bookkeeping", RankCache.prepare)
    RankCache.finish = _timed("page bookkeeping", RankCache.finish)
    RankCache.advance = _timed("page bookkeeping", RankCache.advance)


def decode_plans(engine: Engine, prompts: list[list[int]], steps: int, on_step: Callable[[Plan], None],
                 sampling: SamplingParams | None = None) -> None:
    """Admit and prefill the prompts, then run `steps` decode steps through `on_step`, then release them."""
    ids = [f"p{i}" for i in range(len(prompts))]
    sampling = sampling or SamplingParams()
    report = engine.step(Plan(0, admits=tuple(Admit(r) for r in ids), batch=tuple(
        Chunk(r, tuple(p), 0, sample=True, sampling=sampling) for r, p in zip(ids, prompts, strict=True))))
    last = {s.request_id: s.token_id for s in report.sampled}
    for i in range(1, steps + 1):
        plan = Plan(i, batch=tuple(Chunk(r, (last[r],), len(p) + i - 1, sample=True, sampling=sampling,
                                         sample_index=i) for r, p in zip(ids, prompts, strict=True)))
        on_step(plan)
        last = {s.request_id: s.token_id for s in engine_module.LAST_REPORT.sampled}
    engine.step(Plan(steps + 1, releases=tuple(ids)))


def read_bandwidth(mb: int = 512, runs: int = 5) -> float:
    """Bytes/s of reading a large tensor once (a sum), the way a decode step reads its weights."""
    x = torch.ones(mb << 18)  # mb MiB of float32
    x.sum()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times)


def gemm_rate(shapes: list[tuple[int, int]], batch: int, runs: int = 5) -> tuple[float, float]:
    """(seconds for one pass of [batch, in] x [in, out] over the shapes, FLOP/s of it): the model's own GEMMs
    alone, as fast as this machine does them."""
    ws = [torch.randn(out, inp) for out, inp in shapes]
    xs = [torch.randn(batch, inp) for _, inp in shapes]
    flops = sum(2 * batch * out * inp for out, inp in shapes)
    best = float("inf")
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        for x, w in zip(xs, ws, strict=True):
            torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best, flops / best


def peak_gemm_rate(n: int = 1536, runs: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(runs))
    return 2 * n ** 3 / best


def _time(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' (0: greedy, the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(resolve_model(args.model))
    pages = args.batch * -(-(args.max_prompt + args.steps + 2) // PAGE_SIZE) + 1
    engine = Engine.create(EngineConfig(str(model_dir), page_size=PAGE_SIZE, kv_pages=pages))
    prompts = make_prompts(args.batch, args.min_prompt, args.max_prompt, engine.config.vocab_size, seed=0)

    original_step = Engine.step

    def step(self, plan):
        engine_module.LAST_REPORT = original_step(self, plan)
        return engine_module.LAST_REPORT

    Engine.step = step
    decode_plans(engine, make_prompts(4, 8, 24, engine.config.vocab_size, seed=1), 3, engine.step)  # warm-up
    instrument()
    step_s: list[float] = []

    def timed_step(plan: Plan) -> None:
        before = dict(SPENT)
        t0 = time.perf_counter()
        engine.step(plan)
        step_s.append(time.perf_counter() - t0)
        for k, v in SPENT.items():
            PARTS[k] += v - before.get(k, 0.0)

    decode_plans(engine, prompts, args.steps, timed_step, SamplingParams(temperature=args.temperature,
                                                                          top_p=args.top_p))
    _report(engine, args, step_s, prompts)
    if BUILT:
        print(attention_layout(BUILT[0]))

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode_plans(engine, prompts, 4, engine.step)
    print("\ntop operators by self CPU time (4 decode steps + 1 prefill, torch.profiler):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


def _report(engine: Engine, args: argparse.Namespace, step_s: list[float], prompts: list[list[int]]) -> None:
    n = len(step_s)
    mean_ms = 1e3 * sum(step_s) / n
    print(f"model {Path(engine.model_id).name}, fp32, {args.threads} threads, TP 1, batch {args.batch}, "
          f"prompts {args.min_prompt}..{args.max_prompt} (mean {sum(map(len, prompts)) // len(prompts)}), "
          f"{n} decode steps")
    print(f"decode step: median {1e3 * statistics.median(step_s):.1f} ms, mean {mean_ms:.1f} ms "
          f"-> {args.batch / statistics.median(step_s):.1f} tok/s")
    print("\nparts of a decode step (mean ms per step):")
    parts = dict(PARTS)
    for name, s in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34} {1e3 * s / n:8.2f} ms  {100e3 * s / n / mean_ms:5.1f} %")
    rest = mean_ms - 1e3 * sum(parts.values()) / n
    print(f"  {'Python + element-wise glue':<34} {rest:8.2f} ms  {100 * rest / mean_ms:5.1f} %")

    params = sum(t.numel() for t in engine.model.parameters())
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    shapes = [tuple(m.weight.shape) for m in engine.model.modules()
              if isinstance(m, layers.ColumnParallelLinear | layers.RowParallelLinear | layers.ParallelLMHead)]
    bw = read_bandwidth()
    own_s, own_rate = gemm_rate(shapes, args.batch)
    peak = peak_gemm_rate()
    gemm_ms = 1e3 * sum(v for k, v in parts.items() if k.startswith("GEMM")) / n
    print(f"\nlimits for one decode step at batch {args.batch} ({params / 1e6:.0f} M params, "
          f"{weight_bytes / 2**20:.0f} MiB of weights):")
    print(f"  read every weight once:   {1e3 * weight_bytes / bw:7.1f} ms  (read bandwidth {bw / 1e9:.1f} GB/s)")
    print(f"  the model's GEMMs alone:  {1e3 * own_s:7.1f} ms  ({own_rate / 1e9:.0f} GFLOP/s at its shapes, "
          f"{len(shapes)} GEMMs; measured in the step: {gemm_ms:.1f} ms)")
    print(f"  2 x params x batch FLOPs: {1e3 * 2 * params * args.batch / peak:7.1f} ms  at the large-GEMM rate "
          f"{peak / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
