"""A rank's host work per decode step, part by part, in one process (no gRPC, no coordinator, no model).

    python scripts/bench_rank_host.py --batch 64,256 --steps 100

`bench_control_plane.py` times the same work inside the real rank service, next to the coordinator and the
gRPC streams, so its rank numbers move with everything else on the machine. This one drives
`NoopForwardEngine` (the serving `Engine`'s step with a forward that runs no model) directly with steady decode
plans (every chunk pending, as with overlap) and times each part of the step in the engine's own order:

- parse: the plan read off its serialized message (`plan_from_proto`: the batch's columns, checked);
- prepare: `RankCache.prepare` (releases, admits, each chunk's pages);
- resolve: the pending tokens put into the chunks;
- inputs: the token ids and each pool's `AttentionBatch` (read off the block table) with its decode rows'
  groups, pages and masks (what the attention layers then read);
- draw: the benchmark's stand-in for sampling (not serving work; listed so the sum adds up);
- advance: each chunk's positions held and full pages committed to the prefix index;
- finish: the probe answers and pool counts of the report;
- report: the report's message, serialized.

Torch runs on one thread, as a rank process of `lockstep serve` on a small machine does. `--call-tokens`
groups the decode rows as another device would (`device.attention_call_tokens`: 16384 on a GPU, where a call
costs launches, not gathered slots): the host's share of a GPU step, measured on this CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lockstep.bench.control_plane_rank import FIRST_TOKEN, NoopForwardEngine
from lockstep.engine import _resolved
from lockstep.model import attention_batch
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.steps import PENDING_TOKEN, Admit, Chunk, Plan, Report, Sampled, SamplingParams
from lockstep.wire import plan_from_proto, plan_to_proto, report_to_proto

PARTS = ("parse", "prepare", "resolve", "inputs", "draw", "advance", "finish", "report")


def run(batch: int, steps: int, warmup: int, min_prompt: int, max_prompt: int, page_size: int, seed: int,
        long: int = 0) -> dict[str, float]:
    """Median ms per part (and `step`, their sum) over `steps` decode steps at `batch`; with `long`, one of the
    requests has a prompt that long."""
    rng = random.Random(seed)
    lengths = {f"r{i}": rng.randint(min_prompt, max_prompt) for i in range(batch)}
    if long:
        lengths["r0"] = long
    longest = max(lengths.values()) + steps + warmup + 16
    pages = sum(-(-(n + steps + warmup + 1) // page_size) for n in lengths.values()) + 16
    engine = NoopForwardEngine.build(0, 1, "", page_size, pages, 32000, longest)
    params = SamplingParams()
    prefill = Plan(0, admits=tuple(Admit(r) for r in lengths), batch=tuple(
        Chunk(r, tuple(rng.randrange(FIRST_TOKEN, 32000) for _ in range(n)), 0, True, params, 0)
        for r, n in lengths.items()))
    report = engine.step(prefill)
    if report.error:
        raise RuntimeError(report.error)
    times: dict[str, list[float]] = {part: [] for part in (*PARTS, "step")}
    for step in range(1, warmup + steps + 1):
        sent = plan_to_proto(Plan(step, batch=tuple(Chunk(r, (PENDING_TOKEN,), n + step - 1, True, params, step)
                                                    for r, n in lengths.items()))).SerializeToString()
        marks = [time.perf_counter()]
        plan = plan_from_proto(pb.PlanMsg.FromString(sent))
        marks.append(time.perf_counter())
        engine.cache.prepare(plan)
        marks.append(time.perf_counter())
        drawn, error = engine._pending_tokens(plan, "")
        if error:
            raise RuntimeError(error)
        chunks = _resolved(plan, drawn).batch
        marks.append(time.perf_counter())
        engine._inputs(chunks)
        marks.append(time.perf_counter())
        engine.drawn = dict(zip(chunks.request_ids, engine._draws(chunks.request_ids, chunks.sampling,
                                                                  chunks.sample_index), strict=True))
        marks.append(time.perf_counter())
        engine.cache.advance_all(chunks)
        marks.append(time.perf_counter())
        probes, pools = engine.cache.finish(plan)
        marks.append(time.perf_counter())
        sampled = tuple(Sampled(r, t) for r, t in engine.drawn.items())
        report_to_proto(Report(step, 0, sampled, probes, pools)).SerializeToString()
        marks.append(time.perf_counter())
        if step > warmup:
            for part, a, b in zip(PARTS, marks, marks[1:], strict=False):
                times[part].append(b - a)
            times["step"].append(marks[-1] - marks[0])
    engine.cache.check()
    return {part: statistics.median(v) * 1e3 for part, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="64,256", help="requests decoding at once, e.g. 8,64,256")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long", type=int, default=0, help="one request with a prompt this long among the others")
    p.add_argument("--call-tokens", type=int, default=0,
                   help="what a decode attention call costs in key slots (default: this device's own)")
    args = p.parse_args()
    torch.set_num_threads(1)
    attention_batch.GROUP_CALL_TOKENS = args.call_tokens
    print("rank host work per decode step (median ms, one process, no-op forward)")
    print(f"{'batch':>6}" + "".join(f"{part:>10}" for part in (*PARTS, "step")))
    for batch in (int(b) for b in args.batch.split(",")):
        row = run(batch, args.steps, args.warmup, args.min_prompt, args.max_prompt, args.page_size, args.seed,
                  args.long)
        print(f"{batch:>6}" + "".join(f"{row[part]:>10.3f}" for part in (*PARTS, "step")))


if __name__ == "__main__":
    main()
