"""How arrivals cost the overlap: the share of steps whose next plan was built ahead, and how many steps after
its arrival a request is admitted, under a steady stream of arrivals.

    python scripts/overlap_arrivals.py

The real Scheduler against simulated ranks (tests/sim_ranks.py: each rank the engine's own RankCache around a
fake forward), with overlap on: a request every 1, 2, 4 or 8 steps, 120 in all, each checked against its
reference tokens. Step counts only, no clock: the numbers are the same on any machine.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lockstep.coordinator.request import Request  # noqa: E402
from lockstep.steps import SamplingParams  # noqa: E402
from sim_ranks import Group, make_sched, reference  # noqa: E402


def run(every: int, requests: int, seed: int) -> tuple[int, int, float]:
    """(steps planned ahead, steps, mean steps from arrival to admission) for one arrival interval."""
    rng = random.Random(seed)
    sched = make_sched(ranks=2, budget=64, seqs=16)
    group = Group(sched, [400, 400], overlap=True)
    reqs, arrived = [], {}
    last = (requests - 1) * every
    while group.step <= last or sched.has_work() or group.ahead is not None:
        if group.step % every == 0 and group.step <= last:
            prompt = [rng.randrange(50) for _ in range(rng.randint(5, 30))]
            req = Request(f"r{len(reqs)}", prompt, SamplingParams(), rng.randint(8, 40))
            reqs.append(req)
            arrived[req.request_id] = group.step
            sched.add(req)
        group.run_step()
    if any(r.generated != reference(r) for r in reqs):
        raise AssertionError("a request did not generate its reference tokens")
    admitted: dict[str, int] = {}
    for plan in group.plans:
        for admit in plan.admits:
            admitted.setdefault(admit.request_id, plan.step)
    delay = sum(admitted[r] - arrived[r] for r in admitted) / len(admitted)
    return group.ahead_plans, group.step, delay


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for every in (1, 2, 4, 8):
        ahead, steps, delay = run(every, args.requests, args.seed)
        print(f"a request every {every} step(s): {ahead}/{steps} steps planned ahead ({100 * ahead / steps:.0f}%), "
              f"admitted {delay:.2f} steps after it came")
    return 0


if __name__ == "__main__":
    sys.exit(main())
