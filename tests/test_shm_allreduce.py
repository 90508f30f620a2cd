"""The shared-memory collectives give gloo's numbers bit for bit, keep consecutive calls apart, fail on a
missing peer within the collective timeout, and leave nothing behind in /dev/shm.

Every comparison runs both transports in the same group: the Comm's shared-memory path and gloo's own
`dist.all_reduce` on the Comm's gloo group, over the same inputs.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from distributed import ProcessGroup, free_port
from lockstep.parallel.comm import choose_shm
from lockstep.parallel.shm_allreduce import PREFIX, gloo_ring_order, sweep_stale

SHM = {"LOCKSTEP_COMM": "shm"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (1,), (7,), 16 KB, 1 MB, 4 MB + 1 element, a 2-D shape whose last dim is odd, and (float32) 10 MB, where
# gloo's ring cuts each rank's chunk into several segments
SHAPES = {"float32": [(1,), (7,), (4096,), (1 << 18,), ((1 << 20) + 1,), (33, 1023), (2_500_003,)],
          "bfloat16": [(1,), (7,), (8192,), (1 << 19,), ((1 << 21) + 1,), (33, 1023)]}


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def group(request):
    g = ProcessGroup(request.param, env=SHM)
    yield g
    g.close()


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values of very different magnitudes, so that a different summation order rounds differently."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 13, shape, generator=g).float())
    return x.to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _compare_reduce(comm, dtype_name: str) -> list[tuple[str, bool, str, bool]]:
    """Per shape: (shape, shm == gloo, digest of the shm result, a left-to-right rank-order sum == gloo)."""
    assert comm.transport == "shm"
    dtype = DTYPES[dtype_name]
    rows = []
    for i, shape in enumerate(SHAPES[dtype_name]):
        x = _inputs(comm.rank, shape, dtype, i)
        shm = comm.all_reduce(x.clone())
        gloo = x.clone()
        dist.all_reduce(gloo, group=comm.group)
        everyone = [torch.empty_like(x) for _ in range(comm.world_size)]
        dist.all_gather(everyone, x, group=comm.group)
        naive = everyone[0].clone()
        for part in everyone[1:]:
            naive += part
        rows.append((str(shape), torch.equal(shm, gloo), _digest(shm), torch.equal(naive, gloo)))
    return rows


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_reduce_equals_gloo_bit_for_bit(group, dtype_name):
    results = group.run(_compare_reduce, dtype_name)
    for rows in results:
        assert [(shape, same) for shape, same, _, _ in rows] == [(shape, True) for shape, _, _, _ in rows]
    assert len({tuple(d for _, _, d, _ in rows) for rows in results}) == 1  # every rank holds the same bits
    if group.world_size == 3:  # the order matters on these inputs: a plain 0+1+2 sum is not gloo's
        assert not all(naive for _, _, _, naive in results[0][2:])


def _consecutive(comm, calls: int) -> int:
    """Mixed all-reduces and all-gathers of random shapes, each checked against gloo; how many ran."""
    rng = torch.Generator().manual_seed(7)  # the same shapes on every rank
    for i in range(calls):
        n = int(torch.randint(1, 1 << int(torch.randint(1, 19, (1,), generator=rng)), (1,), generator=rng))
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        x = _inputs(comm.rank, (n,), dtype, i)
        if i % 3 == 2:
            rows = x.view(1, n)
            got = comm.all_gather(rows, dim=int(torch.randint(0, 2, (1,), generator=rng)) - 1)
            parts = [torch.empty_like(rows) for _ in range(comm.world_size)]
            dist.all_gather(parts, rows, group=comm.group)
            want = torch.cat(parts, dim=-1 if got.shape[0] == 1 else 0)
        else:
            got = comm.all_reduce(x.clone())
            want = x.clone()
            dist.all_reduce(want, group=comm.group)
        assert torch.equal(got, want), f"call {i}: {x.dtype} {tuple(x.shape)}"
    return calls


def test_many_consecutive_calls_of_differing_shapes(group):
    assert group.run(_consecutive, 300) == [300] * group.world_size


def _names_gone(comm) -> list[bool]:
    shm = comm.shm
    return [os.path.exists(p) for p in (shm.path, *(f"{shm.path}.w{r}" for r in range(comm.world_size)))]


def test_the_segment_is_unlinked_once_every_rank_has_mapped_it(group):
    for exists in group.run(_names_gone):
        assert not any(exists)


def _transport(comm) -> str:
    return comm.transport


@pytest.mark.parametrize(("mode", "transport"), [("auto", "shm"), ("gloo", "gloo")])
def test_lockstep_comm_picks_the_transport(mode, transport):
    g = ProcessGroup(2, env={"LOCKSTEP_COMM": mode})  # this test host: one x86-64 machine
    try:
        assert g.run(_transport) == [transport, transport]
    finally:
        g.close()


def test_choose_shm_decides_alike_from_every_ranks_view():
    here, there = "host-a/boot-1", "host-b/boot-2"
    assert choose_shm([("auto", here, "x86_64")] * 3) == (True, False)
    assert choose_shm([("auto", here, "x86_64"), ("shm", here, "x86_64")]) == (True, True)
    assert choose_shm([("auto", here, "x86_64"), ("gloo", here, "x86_64")]) == (False, False)
    assert choose_shm([("auto", here, "x86_64"), ("auto", there, "x86_64")]) == (False, False)
    assert choose_shm([("auto", here, "aarch64")] * 2) == (False, False)  # store order not relied on there
    assert choose_shm([("shm", here, "aarch64")] * 2) == (True, True)
    with pytest.raises(RuntimeError, match="different hosts"):
        choose_shm([("shm", here, "x86_64"), ("shm", there, "x86_64")])
    with pytest.raises(ValueError, match="agree"):
        choose_shm([("shm", here, "x86_64"), ("gloo", here, "x86_64")])
    with pytest.raises(ValueError, match="one of"):
        choose_shm([("tcp", here, "x86_64")] * 2)


def test_gloo_ring_order_matches_the_probed_chunks():
    # Probed with torch's gloo: 3 ranks, 7 float32 elements -> chunks [0, 4) and [4, 7).
    assert gloo_ring_order(7, 4, 3) == ((0, 4, (2, 1, 0)), (4, 7, (0, 2, 1)))
    assert [c[:2] for c in gloo_ring_order(4096, 4, 3)] == [(0, 1366), (1366, 2732), (2732, 4096)]
    assert [c[:2] for c in gloo_ring_order((1 << 20) + 1, 4, 3)] == [(0, 349526), (349526, 699052),
                                                                     (699052, 1048577)]


def test_sweep_removes_only_old_names_of_dead_creators(tmp_path):
    dead = subprocess_pid_that_exited()
    old, young, alive = (tmp_path / f"{PREFIX}{dead}-a", tmp_path / f"{PREFIX}{dead}-b",
                         tmp_path / f"{PREFIX}{os.getpid()}-c")
    for p in (old, young, alive):
        p.write_bytes(b"x")
    for p in (old, alive):
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    sweep_stale(str(tmp_path))
    assert not old.exists() and young.exists() and alive.exists()


def subprocess_pid_that_exited() -> int:
    p = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    return p.pid


def _rank(rank: int, world_size: int, rendezvous: str, out: mp.Queue, leave_after: int, timeout_s: float,
          how: str) -> None:
    """All-reduce `leave_after` times, then rank 1 leaves (`how`: stays alive but never comes, or is killed)
    and the others report how their next all-reduce ended."""
    os.environ.update(SHM)
    torch.set_num_threads(1)
    from lockstep.parallel.comm import init_comm

    comm = init_comm(rank, world_size, rendezvous, "cpu", timeout_s=60, collective_timeout_s=timeout_s)
    for _ in range(leave_after):
        total = comm.all_reduce(torch.ones(3)).tolist()
    out.put((rank, "joined", comm.shm.path, total))
    if rank == 1:
        if how == "killed":
            out.close()
            out.join_thread()  # the report must leave before the process does
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # alive but never arrives
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(3))
        out.put((rank, "completed", "", time.monotonic() - t0))
    except Exception as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}", "", time.monotonic() - t0))


def _start(world_size: int, rendezvous: str, leave_after: int, timeout_s: float = 2.0, how: str = "stuck"):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, rendezvous, out, leave_after, timeout_s, how),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    return out, procs


def test_a_missing_peer_fails_the_collective_within_the_timeout_naming_it():
    out, procs = _start(3, f"127.0.0.1:{free_port()}", leave_after=5)
    try:
        got = [out.get(timeout=90) for _ in range(5)]
        assert sorted(g[3] for g in got if g[1] == "joined") == [[3.0] * 3] * 3
        failed = sorted(g for g in got if g[1] != "joined")
        assert [rank for rank, _, _, _ in failed] == [0, 2]
        for _, what, _, seconds in failed:  # both survivors name the rank that did not come
            assert what.startswith("PeerTimeout") and "rank(s) [1]" in what, what
            assert 1.5 < seconds < 10, f"the collective took {seconds:.1f} s to fail"
    finally:
        for p in procs:
            p.kill()


def test_a_killed_peer_breaks_the_collective_at_once_not_after_the_timeout():
    out, procs = _start(2, f"127.0.0.1:{free_port()}", leave_after=3, timeout_s=60, how="killed")
    try:
        got = [out.get(timeout=90) for _ in range(3)]
        (rank, what, _, seconds), = [g for g in got if g[1] != "joined"]
        assert rank == 0 and what.startswith("PeerLost") and "rank(s) [1] exited" in what, what
        assert seconds < 5, f"the collective took {seconds:.1f} s to fail"
    finally:
        for p in procs:
            p.kill()


def test_a_killed_group_leaves_nothing_and_a_new_one_at_the_same_rendezvous_works():
    rendezvous = f"127.0.0.1:{free_port()}"
    out, procs = _start(2, rendezvous, leave_after=3)
    try:
        first = [out.get(timeout=90) for _ in range(2)]
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    paths = {g[2] for g in first}
    assert len(paths) == 1 and not any(os.path.exists(p) for p in paths)
    pids = [p.pid for p in procs]
    out, procs = _start(2, rendezvous, leave_after=2)
    pids += [p.pid for p in procs]
    try:
        second = [out.get(timeout=90) for _ in range(3)]
        assert sorted(g[3] for g in second if g[1] == "joined") == [[2.0] * 3] * 2
        assert {g[2] for g in second if g[1] == "joined"}.isdisjoint(paths)
    finally:
        for p in procs:
            p.kill()
    leftovers = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"{PREFIX}{pid}-") for pid in pids)]
    assert not leftovers


def _one_rank_cannot_map(comm) -> tuple[bool, float, list[str]]:
    """Rank 1's mapping fails (say its /dev/shm is another host's): what select_shm gives, then a gloo sum."""
    import torch.distributed as dist

    from lockstep.parallel import comm as comm_module
    from lockstep.parallel import shm_allreduce

    real = shm_allreduce.ShmAllReduce

    def refusing(*args, create: bool = False, **kwargs):
        if comm.rank == 1:
            raise OSError("injected: this rank cannot map the segment")
        return real(*args, create=create, **kwargs)

    shm_allreduce.ShmAllReduce = refusing
    try:
        chosen = comm_module.select_shm(comm.rank, comm.world_size, timeout_s=30.0)
    finally:
        shm_allreduce.ShmAllReduce = real
    ones = torch.ones(4)
    dist.all_reduce(ones)
    left = [n for n in os.listdir(shm_allreduce.SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")]
    return chosen is None, float(ones[0]), left


def test_a_rank_that_cannot_map_the_segment_makes_every_rank_fall_back_to_gloo_together():
    """Seed 001's collective entered by some ranks only: had rank 0 gone on with shared memory while rank 1
    fell back to gloo, their first collective would wait for each other for ever. Every rank learns of any
    rank's failure and all fall back, and rank 0 leaves no segment behind."""
    g = ProcessGroup(2, env={"LOCKSTEP_COMM": "auto"})
    try:
        assert g.run(_one_rank_cannot_map) == [(True, 2.0, []), (True, 2.0, [])]
    finally:
        g.close()
