"""A collective whose peer never comes fails after the collective timeout, not after the rendezvous one.

When the coordinator declares a rank dead, the survivors sit in a collective that cannot complete; they
must find their group broken soon (and exit, to have it recreated), while a peer that is merely slow to
start must still be waited for at the rendezvous.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from distributed import free_port


def _rank(rank: int, rendezvous: str, out: mp.Queue) -> None:
    import torch

    from lockstep.parallel.comm import init_comm

    torch.set_num_threads(1)
    if rank == 1:
        time.sleep(4)  # slow to start: longer than the collective timeout, well within the rendezvous one
    comm = init_comm(rank, 2, rendezvous, "cpu", timeout_s=60, collective_timeout_s=2)
    out.put((rank, "joined", comm.all_reduce(torch.ones(1)).item()))
    if rank == 1:
        time.sleep(20)  # never joins the next collective
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1))
        out.put((rank, "completed", time.monotonic() - t0))
    except Exception as exc:
        out.put((rank, f"failed: {type(exc).__name__}", time.monotonic() - t0))


def test_a_collective_without_its_peer_fails_after_the_collective_timeout():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, rendezvous, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=60) for _ in range(3)]
        joined = sorted((r, v) for r, what, v in got if what == "joined")
        assert joined == [(0, 2.0), (1, 2.0)]  # the slow starter was waited for
        (rank, what, seconds), = [g for g in got if g[1] != "joined"]
        assert rank == 0 and what.startswith("failed"), got
        assert seconds < 15, f"the collective took {seconds:.1f} s to fail"
    finally:
        for p in procs:
            p.kill()
