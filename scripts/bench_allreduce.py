"""Time one all-reduce over gloo and over the shared-memory transport, against a plain copy of the same bytes.

    python3 scripts/bench_allreduce.py [--tp 2 3] [--iters 200] [--threads 1] [--waits fifo sleep spin]
                                       [--spin-us 50] [--slot-kb 1024] [--sizes-kb 16 64 256 1024 4096]

Starts `tp` real ranks (spawned processes, as `lockstep serve` runs them) joined with `init_comm` and
LOCKSTEP_COMM=shm; each size is all-reduced `iters` times per transport, each call timed on its own.
Prints two tables: per TP and size (float32), the median µs per call (the slowest rank's median) of a
`copy_` of the same bytes, of gloo, and of shared memory with each waiting strategy; then the CPU time
per call of all ranks together (what a spinning waiter costs the machine). `fifo` is the kept
one (spin briefly, then sleep on a FIFO the peers write to); `sleep` (spin, then sleep with exponential
backoff capped at 200 µs) and `spin` (never sleep) are the alternatives measured and not kept: with more
ranks than cores a spinning waiter takes the core of the rank it waits for.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _sleep_wait(self) -> None:
    """Alternative: sleep 10 µs doubling to 200 µs between looks at the counters."""
    from lockstep.parallel.shm_allreduce import PeerTimeout

    deadline, pause = time.monotonic() + self.timeout_s, 10e-6
    while missing := self._missing():
        if time.monotonic() > deadline:
            raise PeerTimeout(f"rank {self.rank}: timed out waiting for rank(s) {missing}")
        time.sleep(pause)
        pause = min(2 * pause, 200e-6)


def _spin_wait(self) -> None:
    """Alternative: look at the counters until they are all there (yielding the core, never sleeping)."""
    while self._missing():
        os.sched_yield()


def _timed(fn, iters: int) -> tuple[float, float]:
    """(median wall µs per call, this process's CPU µs per call): a waiter that spins shows in the second."""
    times = []
    cpu0 = time.process_time_ns()
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3, (time.process_time_ns() - cpu0) / iters / 1e3


def _rank(rank: int, tp: int, rendezvous: str, args: argparse.Namespace, out: mp.Queue) -> None:
    os.environ["LOCKSTEP_COMM"] = "shm"
    import torch
    import torch.distributed as dist

    from lockstep.parallel import shm_allreduce
    from lockstep.parallel.comm import init_comm
    from lockstep.parallel.shm_allreduce import ShmAllReduce

    shm_allreduce.SPIN_S = args.spin_us * 1e-6
    shm_allreduce.SLOT_BYTES = args.slot_kb << 10
    iters, threads, waits = args.iters, args.threads, args.waits

    torch.set_num_threads(threads)
    comm = init_comm(rank, tp, rendezvous, "cpu", timeout_s=120)
    kept = ShmAllReduce._wait
    strategies = {"fifo": kept, "sleep": _sleep_wait, "spin": _spin_wait}
    rows = []
    for size in args.sizes:
        n = max(1, iters if size <= 1 << 20 else iters // 4)
        x = torch.randn(max(1, size // 4))  # summed in place n times it overflows to inf/nan: the speed is the same
        y = torch.empty_like(x)
        row = {"copy_": _timed(lambda x=x, y=y: y.copy_(x), n)}
        dist.barrier()
        row["gloo"] = _timed(lambda x=x: dist.all_reduce(x), n)
        for wait in waits:
            ShmAllReduce._wait = strategies[wait]
            dist.barrier()
            row[f"shm {wait}"] = _timed(lambda x=x: comm.all_reduce(x), n)
        ShmAllReduce._wait = kept
        rows.append(row)
    out.put((rank, rows))
    comm.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tp: int, args: argparse.Namespace) -> list[tuple[dict[str, float], dict[str, float]]]:
    """Per size: (the slowest rank's median wall µs, the ranks' CPU µs together) per column."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, tp, rendezvous, args, out)) for r in range(tp)]
    for p in procs:
        p.start()
    per_rank = [out.get(timeout=1800)[1] for _ in range(tp)]
    for p in procs:
        p.join()
    return [({k: max(r[i][k][0] for r in per_rank) for k in per_rank[0][i]},
             {k: sum(r[i][k][1] for r in per_rank) for k in per_rank[0][i]}) for i in range(len(args.sizes))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--iters", type=int, default=200, help="calls per size and transport (a quarter at 4 MB)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--waits", nargs="+", default=["fifo", "sleep"], choices=["fifo", "sleep", "spin"])
    ap.add_argument("--spin-us", type=float, default=50.0, help="fifo: yielding spin before sleeping")
    ap.add_argument("--slot-kb", type=int, default=1024, help="segment slot per rank (larger tensors: pieces)")
    ap.add_argument("--sizes-kb", type=float, nargs="+", default=[s / 1024 for s in SIZES],
                    help="tensor sizes in KB (decode all-reduces are hidden * batch * 4 bytes: often a few KB)")
    args = ap.parse_args(argv)
    args.sizes = [max(4, int(kb * 1024)) // 4 * 4 for kb in args.sizes_kb]
    print(f"cores: {os.cpu_count()}, torch threads per rank: {args.threads}, float32; fifo spin {args.spin_us:g} µs, "
          f"slot {args.slot_kb} KB", flush=True)
    results = {tp: run(tp, args) for tp in args.tp}
    _table("median wall µs per call (slowest rank)", results, args.sizes, 0)
    _table("CPU µs per call (all ranks together)", results, args.sizes, 1)


def _table(title: str, results: dict[int, list], sizes: list[int], which: int) -> None:
    print(f"\n{title}")
    header = None
    for tp, per_size in results.items():
        for size, pair in zip(sizes, per_size, strict=True):
            row = pair[which]
            if header is None:
                header = ["TP", "size", *row, "gloo/shm"]
                print(" ".join(f"{h:>12}" for h in header))
            shm = row.get("shm fifo", min(v for k, v in row.items() if k.startswith("shm")))
            cells = [str(tp), f"{size / 1024:g} KB", *(f"{v:.1f}" for v in row.values()), f"{row['gloo'] / shm:.2f}x"]
            print(" ".join(f"{c:>12}" for c in cells), flush=True)

if __name__ == "__main__":
    sys.exit(main())
