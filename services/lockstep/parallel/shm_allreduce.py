"""All-reduce and all-gather through one shared-memory segment, for the ranks of a group that share a host.

gloo moves a same-host collective through TCP loopback: a syscall and a copy per segment, per hop, and a
ring of `world_size - 1` hops. Here each rank copies its tensor into its own slot of a segment every rank
has mapped, says so by bumping its generation counter, and once every peer's counter has caught up sums
the slots itself. Every rank sums in gloo's ring order, so the result is the one gloo would give, bit for
bit, and the same on every rank (the model's ranks sample from it independently, so they must agree).

Waiting sleeps: after a short spin a rank blocks in `select` on its own FIFO, which each arriving peer
writes a byte to. With fewer cores than ranks a spinning waiter would take the core from the very peer it
waits for. A wait is bounded by the collective timeout and names the ranks that never came; a peer that
exits is noticed within a sleep slice, as gloo notices its socket reset: each rank holds a lock on one byte
of the segment, which the kernel drops when the process ends, however it ends.

The segment's name is random and rank 0 unlinks it (and the FIFOs) as soon as every rank has opened it,
so a group that dies, however it dies, leaves nothing in /dev/shm, and a new group at the same
rendezvous never meets an old segment. Publishing a slot before its counter relies on the store order
of x86-64 (stores are not reordered with stores); `comm.init_comm` picks this transport on its own only there.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import mmap
import os
import secrets
import select
import time

import torch

SHM_DIR = "/dev/shm"
PREFIX = "lockstep-shm-"
SLOT_BYTES = 1 << 20  # per rank and buffer; larger tensors go through in slot-sized pieces
SPIN_S = 50e-6  # how long a waiting rank looks at the counters (yielding between looks) before it sleeps
SLEEP_SLICE_S = 0.05  # the longest a sleeping rank goes without looking at the counters
GLOO_MAX_SEGMENT = 1 << 20  # gloo's AllreduceOptionsImpl::kMaxSegmentSize: it sets the ring's chunks
STALE_AFTER_S = 60.0
_LINE = 64  # one cache line per rank's counter


class PeerLost(RuntimeError):
    """A peer exited while this rank waited for it: the group is broken, as when gloo's socket to it resets."""


class PeerTimeout(PeerLost):
    """A peer did not reach a collective within the timeout: the group is broken, as after a gloo timeout."""


@functools.lru_cache(maxsize=512)
def gloo_ring_order(numel: int, element_size: int, world_size: int) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """(start, end, ranks in summation order) per chunk of gloo's ring all-reduce of `numel` elements.

    gloo splits the buffer into `world_size` chunks (whole segments, see allreduce.cc `ring`); chunk `c`
    travels the ring starting at rank c-1 and ends at rank c, so it is x[c-1] + x[c-2] + ... + x[c], added
    left to right. Each addition is one rounded operation on the tensor's dtype, so only the order counts.
    """
    total = numel * element_size
    max_segment = element_size * max(1, GLOO_MAX_SEGMENT // element_size)
    segments = _round_up(max(_ceil_div(total, max_segment), 2 * world_size), world_size)
    segment_bytes = _round_up(_ceil_div(total, segments), element_size)
    chunk = segments // world_size * segment_bytes // element_size
    order = []
    for c in range(world_size):
        start, end = c * chunk, min(numel, (c + 1) * chunk)
        if start < end:
            order.append((start, end, tuple((c - k) % world_size for k in range(1, world_size + 1))))
    return tuple(order)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def sweep_stale(directory: str = SHM_DIR) -> None:
    """Unlink segments and FIFOs left by a rank 0 killed in the instant between creating and unlinking them."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            if time.time() - os.stat(path).st_mtime < STALE_AFTER_S or _alive(pid):
                continue
            os.unlink(path)
        except (ValueError, OSError):
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmAllReduce:
    """One rank's mapping of its group's segment; every rank must make the same calls in the same order."""

    def __init__(self, path: str, rank: int, world_size: int, timeout_s: float, slot_bytes: int, create: bool,
                 nonce: bytes | None = None) -> None:
        self.path = path
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        self.broken = ""
        self._gen = 0
        self._fds: list[int] = []
        header = _round_up(_LINE * (world_size + 1), 4096)
        size = header + 2 * world_size * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        self._fd = fd  # kept open: it holds this rank's lock, the sign of life its peers test
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write into a full tmpfs
                for r in range(world_size):
                    os.mkfifo(self._fifo(r), 0o600)
            elif os.fstat(fd).st_size != size:
                raise OSError(f"{path} is {os.fstat(fd).st_size} bytes, not the {size} of this group")
            self._mm = mmap.mmap(fd, size)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)  # byte `rank`, dropped by the kernel at exit
        except BaseException:
            os.close(fd)
            raise
        self.nonce = nonce if nonce is not None else secrets.token_bytes(8)
        if create:
            self._mm[:8] = self.nonce
        elif self._mm[:8] != self.nonce:
            self._mm.close()
            os.close(fd)
            raise OSError(f"{path} is not the segment rank 0 created (another host's /dev/shm?)")
        # O_RDWR: a FIFO opened so never blocks in open and never sees EOF when a peer exits.
        self._fds = [os.open(self._fifo(r), os.O_RDWR | os.O_NONBLOCK) for r in range(world_size)]
        self._counters = memoryview(self._mm)[:header].cast("q")
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header, count=2 * world_size * slot_bytes)
        self._slots = [[data[(b * world_size + r) * slot_bytes:(b * world_size + r + 1) * slot_bytes]
                        for r in range(world_size)] for b in range(2)]
        self._peers = [r for r in range(world_size) if r != rank]

    def _fifo(self, rank: int) -> str:
        return f"{self.path}.w{rank}"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group in place, in gloo's order, and return it."""
        if not t.is_contiguous():
            work = t.contiguous()
            return t.copy_(self.all_reduce(work))
        flat = t.view(-1)
        n, size = flat.numel(), t.element_size()
        order = gloo_ring_order(n, size, self.world_size)
        per = self.slot_bytes // size
        for a in range(0, n, per):
            b = min(n, a + per)
            buf = self._arrive(flat[a:b])
            self._wait()
            for start, end, ranks in order:
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    self._sum(flat[lo:hi], [self._view(buf, r, t.dtype, lo - a, hi - a) for r in ranks], ranks)
        return t

    def _sum(self, out: torch.Tensor, parts: list[torch.Tensor], ranks: tuple[int, ...]) -> None:
        """out = parts[0] + parts[1] + ..., left to right, where `out` already holds this rank's part."""
        acc: torch.Tensor | None = None  # the running sum while it is not yet in `out`
        in_out = ranks[0] == self.rank
        if not in_out:
            acc = parts[0]
        for r, part in zip(ranks[1:], parts[1:], strict=True):
            if r == self.rank:
                out.add_(acc)  # x_me + acc: a single rounded addition, the same as acc + x_me
                in_out = True
            elif in_out:
                out.add_(part)
            elif acc is parts[0]:
                acc = torch.add(acc, part)
            else:
                acc.add_(part)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` in rank order."""
        t = t.contiguous()
        flat = t.view(-1)
        n = flat.numel()
        parts = torch.empty((self.world_size, n), dtype=t.dtype)
        per = self.slot_bytes // t.element_size()
        for a in range(0, n, per):
            b = min(n, a + per)
            buf = self._arrive(flat[a:b])
            self._wait()
            for r in range(self.world_size):
                parts[r, a:b].copy_(flat[a:b] if r == self.rank else self._view(buf, r, t.dtype, 0, b - a))
        return torch.cat(list(parts.view(self.world_size, *t.shape)), dim=dim)

    def _view(self, buf: int, rank: int, dtype: torch.dtype, lo: int, hi: int) -> torch.Tensor:
        return self._slots[buf][rank].view(dtype)[lo:hi]

    def _arrive(self, piece: torch.Tensor) -> int:
        """Publish this rank's piece for the next generation and wake the peers; returns its buffer.

        Two buffers alternate: a rank can only be one generation ahead of a peer still reading (it cannot
        pass the next wait without that peer), so it never overwrites a slot that is being read.
        """
        if self.broken:
            raise PeerLost(f"rank {self.rank}: the shared-memory group is broken: {self.broken}")
        self._gen += 1
        buf = self._gen & 1
        self._view(buf, self.rank, piece.dtype, 0, piece.numel()).copy_(piece)
        self._counters[_LINE // 8 * (self.rank + 1)] = self._gen
        for r in self._peers:
            try:
                os.write(self._fds[r], b"\0")
            except BlockingIOError:
                pass  # its FIFO is full of wake-ups it has not needed; it will see the counter anyway
        return buf

    def _missing(self) -> list[int]:
        c, gen, step = self._counters, self._gen, _LINE // 8
        return [r for r in self._peers if c[step * (r + 1)] < gen]

    def _exited(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` whose lock is gone: they exited (a killed process too, even one not yet reaped)."""
        gone = []
        for r in ranks:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, r)
            except OSError:
                continue  # held: alive
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, r)
            gone.append(r)
        return gone

    def _wait(self) -> None:
        """Until every peer has published this generation: spin briefly, yielding the core to whoever wants it
        (the peer, when it shares this core), then sleep on this rank's FIFO until a peer writes to it."""
        spin_end = time.perf_counter() + SPIN_S
        while self._missing():
            if time.perf_counter() > spin_end:
                break
            os.sched_yield()
        else:
            return
        deadline = time.monotonic() + self.timeout_s
        fd = self._fds[self.rank]
        while missing := self._missing():
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = (f"collective #{self._gen} timed out after {self.timeout_s:g} s waiting for "
                               f"rank(s) {missing} (dead, stuck, or out of step with this rank)")
                raise PeerTimeout(f"rank {self.rank}: {self.broken}")
            if select.select([fd], [], [], min(left, SLEEP_SLICE_S))[0]:
                try:
                    os.read(fd, 1 << 16)
                except BlockingIOError:
                    pass
            elif gone := [r for r in self._exited(missing) if r in self._missing()]:  # gone without arriving
                self.broken = f"rank(s) {gone} exited before collective #{self._gen}"
                raise PeerLost(f"rank {self.rank}: {self.broken}")

    def unlink(self) -> None:
        """Remove the names; the mappings stay valid, and the memory goes with the last one."""
        for p in (self.path, *(self._fifo(r) for r in range(self.world_size))):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap and close (idempotent); a still exported view keeps the mapping until the process exits."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._fd >= 0:
            os.close(self._fd)  # and with it this rank's lock: its peers now see it gone
            self._fd = -1
        self._slots = []
        if getattr(self, "_counters", None) is not None:
            self._counters.release()
            self._counters = None
            try:
                self._mm.close()
            except BufferError:
                pass


def create_segment(rank: int, world_size: int, timeout_s: float, slot_bytes: int | None = None,
                   directory: str = SHM_DIR) -> ShmAllReduce:
    """Rank 0's segment under a fresh random name (pid first, for `sweep_stale`)."""
    sweep_stale(directory)
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        return ShmAllReduce(path, rank, world_size, timeout_s, slot_bytes or SLOT_BYTES, create=True)
    except BaseException:
        for p in (path, *(f"{path}.w{r}" for r in range(world_size))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise


def join_group(rank: int, world_size: int, timeout_s: float, slot_bytes: int | None = None) -> ShmAllReduce:
    """Collective over the default (gloo) group: rank 0 creates the segment, every rank maps it, rank 0 unlinks.

    Raises OSError on every rank alike when any rank cannot map it (say its /dev/shm is another one), so
    the ranks fall back together.
    """
    import torch.distributed as dist

    seg: ShmAllReduce | None = None
    made: list[object] = [None]
    try:
        if rank == 0:
            try:
                seg = create_segment(rank, world_size, timeout_s, slot_bytes)
                made = [(seg.path, seg.nonce, seg.slot_bytes)]
            except OSError as exc:
                made = [("", f"{type(exc).__name__}: {exc}", 0)]
        dist.broadcast_object_list(made, src=0)
        path, nonce, slot_bytes = made[0]  # rank 0's slot size is the group's
        error = "" if path else f"rank 0 could not create it: {nonce}"
        if path and seg is None:
            try:
                seg = ShmAllReduce(path, rank, world_size, timeout_s, slot_bytes, create=False, nonce=nonce)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        errors: list[str] = [""] * world_size
        dist.all_gather_object(errors, error)
    finally:
        if rank == 0 and seg is not None:
            seg.unlink()  # every rank has mapped it or given up: the names are no longer needed
    bad = {r: e for r, e in enumerate(errors) if e}
    if bad:
        if seg is not None:
            seg.close()
        raise OSError(f"no shared-memory segment for the group: {bad}")
    assert seg is not None
    return seg
