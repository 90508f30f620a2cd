"""The coordinator's host work per decode step, part by part, in one process (no gRPC, no asyncio).

    python scripts/bench_coordinator_host.py --batch 64,256 --steps 200

`bench_control_plane.py` times the coordinator inside the real service, next to the rank processes and the gRPC
streams, on the same cores, so its numbers move with everything else on the machine. This one drives the real
`Scheduler` as the group's step loop does with overlap (the plan of step k+1 built and sent while step k runs,
then step k's reports applied), against one rank: `NoopForwardEngine` (the serving engine's step, no model) in
this process, reached through the real plan and report messages. Only the coordinator's parts are timed:

- ahead: `Scheduler.plan_ahead` (every running request carried on, pages counted);
- message: the plan's message, checked and serialized (`plan_to_proto`);
- reports: the rank's report message read (`report_from_proto`);
- apply: `Scheduler.apply` (tokens, stops, the events for the API).

Every request decodes from the start of the measured steps (prompts of `min_prompt`..`max_prompt` random
tokens, enough pages for all), and no step may fall back to a plan built from the reports: the script fails
if one does, so what it times is the steady overlapped decode step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lockstep.bench.control_plane_rank import FIRST_TOKEN, MODEL_ID, NoopForwardEngine
from lockstep.coordinator.request import Request
from lockstep.coordinator.scheduler import TOKEN, Scheduler
from lockstep.kv.page_keys import key_salt
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.steps import Report, SamplingParams
from lockstep.wire import plan_from_proto, plan_to_proto, report_from_proto, report_to_proto

PARTS = ("ahead", "message", "reports", "apply")


def run(batch: int, steps: int, warmup: int, min_prompt: int, max_prompt: int, page_size: int, seed: int
        ) -> dict[str, float]:
    """Median ms per part (and `step`, their sum) over `steps` overlapped decode steps at `batch`."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_prompt, max_prompt) for _ in range(batch)]
    budget = max(4096, max_prompt)
    new_tokens = steps + warmup + -(-sum(lengths) // budget) + 8  # the first admitted decode during the prefill
    context = max_prompt + new_tokens + 1
    pages = sum(-(-(n + new_tokens + 1) // page_size) for n in lengths) + 16
    engine = NoopForwardEngine.build(0, 1, "", page_size, pages, 32000, context)
    sched = Scheduler(page_size, key_salt(MODEL_ID, page_size), budget, batch, 1, True, context)
    for i, n in enumerate(lengths):
        sched.add(Request(f"r{i}", [rng.randrange(FIRST_TOKEN, 32000) for _ in range(n)],
                          SamplingParams(temperature=1.0), max_tokens=new_tokens))

    def exchange(msg: bytes) -> bytes:
        return report_to_proto(engine.step(plan_from_proto(pb.PlanMsg.FromString(msg)))).SerializeToString()

    step, reports = 0, []
    while not sched.running or sched.waiting or any(not r.generated for r in sched.running):  # prefill
        plan = sched.plan(step, reports)
        reports = [report_from_proto(pb.ReportMsg.FromString(exchange(plan_to_proto(plan).SerializeToString())))]
        sched.apply(reports)
        step += 1
    times: dict[str, list[float]] = {part: [] for part in (*PARTS, "step")}
    tokens = 0
    plan = sched.plan(step, reports)
    sent = plan_to_proto(plan).SerializeToString()
    for k in range(warmup + steps):
        report = exchange(sent)  # the ranks run step k...
        marks = [time.perf_counter()]
        ahead = sched.plan_ahead(plan.step + 1)  # ...while the coordinator plans k + 1
        marks.append(time.perf_counter())
        if ahead is None:
            raise RuntimeError(f"step {plan.step + 1} could not be planned ahead: not a steady decode step")
        sent = plan_to_proto(ahead).SerializeToString()
        marks.append(time.perf_counter())
        got: list[Report] = [report_from_proto(pb.ReportMsg.FromString(report))]
        marks.append(time.perf_counter())
        events = sched.apply(got)
        marks.append(time.perf_counter())
        plan = ahead
        if k >= warmup:
            tokens += sum(ev.kind is TOKEN for ev in events)
            for part, a, b in zip(PARTS, marks, marks[1:], strict=False):
                times[part].append(b - a)
            times["step"].append(marks[-1] - marks[0])
    if tokens != batch * steps:
        raise RuntimeError(f"{tokens} tokens in {steps} steps of {batch} requests")
    return {part: statistics.median(v) * 1e3 for part, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="64,256", help="requests decoding at once, e.g. 8,64,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1200)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("coordinator host work per decode step (median ms, one process, overlap, a no-op rank)")
    print(f"{'batch':>6}" + "".join(f"{part:>10}" for part in (*PARTS, "step")))
    for batch in (int(b) for b in args.batch.split(",")):
        row = run(batch, args.steps, args.warmup, args.min_prompt, args.max_prompt, args.page_size, args.seed)
        print(f"{batch:>6}" + "".join(f"{row[part]:>10.3f}" for part in (*PARTS, "step")))


if __name__ == "__main__":
    main()
