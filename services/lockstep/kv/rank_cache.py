"""One rank's page bookkeeping for the plans it carries out: the same code in the engine and in the tests.

A rank carries out plan k in the order of DESIGN.md's step protocol. Everything in that order that is
about pages rather than tensors is here, so the engine keeps only the agreement collective, the forward
and sampling, and a test drives the real bookkeeping with a fake forward:

    prepare(plan)     releases, pins of the admitted prefixes, pages for every chunk (or StepRefused)
                      ... the group agrees whether the step goes on ...
    undo_admits()     refused: what this step's admits pinned and allocated goes back
    table(request)    the page table the forward reads and writes
    advance(chunk)    the chunk ran: its positions are held and its full pages committed to the index
    finish(plan)      an operator's flush, then the probe answers and the pool counts for the report

The flush comes after the step's pins and commits, so it never takes a prefix that the plan's admits were
agreed on (pinned pages stay indexed), and the probes answer from the flushed state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lockstep.kv.allocator import OutOfPages, PagePool, PrefixNotHeld
from lockstep.kv.page_keys import next_key
from lockstep.kv.paging import pages_for
from lockstep.steps import Admit, Chunk, Plan, PoolState, ProbeAnswer

log = logging.getLogger("lockstep.kv")


class StepRefused(RuntimeError):
    """This rank cannot carry out the plan; the whole group then skips the step together.

    Raised by `prepare` with the rank in its text; `__cause__` is what refused (PrefixNotHeld,
    OutOfPages, a ValueError, or a bug), so a test can tell a refusal it planned from one it did not.
    """


@dataclass
class _Sequence:
    """What this rank holds of one request: positions [0, length) are in its pages.

    The first `committed` pages are committed (indexed, or kept private where the index already held the
    key), the last of them under the key `parent`; with prefix caching on, `pending` holds the tokens of
    positions [committed * page_size, length), the page not yet full.
    """

    length: int
    committed: int
    parent: bytes | None
    pending: list[int] = field(default_factory=list)


class RankCache:
    """One rank's KV pages as plans change them: its pool, its prefix index and what each request holds."""

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        salt: bytes,
        max_model_len: int,
        prefix_caching: bool = True,
        rank: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.salt = salt
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.rank = rank
        self._seqs: dict[str, _Sequence] = {}
        self._admitted: list[str] = []  # this step's admits that were pinned: undone if the group refuses

    def prepare(self, plan: Plan) -> None:
        """Releases, then the pins of the admitted prefixes, then the pages of every chunk.

        Raises StepRefused when this rank cannot go on; the releases stay done, and what the admits
        pinned stays until `undo_admits`. Any exception becomes StepRefused: a rank must still reach the
        group's agreement, or its peers would wait for it in that collective forever.
        """
        self._admitted = []
        if plan.abstain:
            raise StepRefused(f"rank {self.rank} abstains from step {plan.step}: its coordinator is catching it "
                              "up to the step its peers are in")
        self._release(plan)
        try:
            for admit in plan.admits:
                self._admit(admit)
            for chunk in plan.batch:
                self._reserve(chunk)
        except (PrefixNotHeld, OutOfPages, StepRefused, ValueError) as exc:
            raise StepRefused(f"rank {self.rank}: {exc}") from exc
        except Exception as exc:
            log.exception("rank %d: preparing step %d failed", self.rank, plan.step)
            raise StepRefused(f"rank {self.rank}: {type(exc).__name__} while preparing the step: {exc}") from exc

    def undo_admits(self) -> None:
        """The group refused the step: drop what its admits pinned and allocated, so it can come again.

        Only admits this step carried out go back; a request refused for being admitted twice keeps what
        it held. Pages reserved for running requests stay theirs: their chunk comes again.
        """
        for request_id in self._admitted:
            self.pool.release(request_id)
            self._seqs.pop(request_id, None)
        self._admitted = []

    def table(self, request_id: str) -> list[int]:
        """The request's pages in position order, covering every position its chunk of this step writes."""
        return self.pool.table(request_id)

    def advance(self, chunk: Chunk) -> None:
        """The chunk was computed: hold its positions and commit the pages it filled into the index."""
        seq = self._seqs[chunk.request_id]
        seq.length += len(chunk.token_ids)
        if not self.prefix_caching:
            return
        seq.pending.extend(chunk.token_ids)
        ps = self.page_size
        if len(seq.pending) < ps:
            return
        table = self.pool.table(chunk.request_id)
        while len(seq.pending) >= ps:
            key = next_key(seq.parent, seq.pending[:ps], self.salt)
            self.pool.commit(chunk.request_id, table[seq.committed], key)
            seq.parent = key
            seq.committed += 1
            del seq.pending[:ps]

    def finish(self, plan: Plan) -> tuple[tuple[ProbeAnswer, ...], tuple[PoolState, ...]]:
        """An operator's flush, if the plan asks, then (probe answers, pool counts) for the step's report."""
        self._admitted = []
        if plan.flush_prefix_cache:
            self.pool.flush()
        return tuple(self.probe(p.request_id, p.keys) for p in plan.probes), self.stats()

    def probe(self, request_id: str, keys: tuple[bytes, ...]) -> ProbeAnswer:
        """How many leading pages of this chain the index holds, and how many of those are pinned."""
        if not self.prefix_caching:
            return ProbeAnswer(request_id, 0, 0)
        matched, pinned = self.pool.probe(keys)
        return ProbeAnswer(request_id, matched, pinned)

    def stats(self) -> tuple[PoolState, ...]:
        """Every pool's page counts, as the report carries them."""
        return (self.pool.stats(),)

    def totals(self) -> tuple[tuple[str, int], ...]:
        """(pool name, total pages) of every pool: what the rank tells the coordinator it serves."""
        return ((self.pool.name, self.pool.num_pages),)

    def check(self) -> None:
        """Raise AssertionError unless the pool is consistent and every request's pages cover what it holds."""
        self.pool.check()
        if set(self._seqs) != set(self.pool.owners()):
            raise AssertionError(f"requests {sorted(self._seqs)} but pool owners {sorted(self.pool.owners())}")
        for request_id, seq in self._seqs.items():
            pages = len(self.pool.table(request_id))
            if pages < pages_for(seq.length, self.page_size) or seq.committed > pages:
                raise AssertionError(
                    f"{request_id}: {pages} pages for {seq.length} positions, {seq.committed} of them committed"
                )

    def _release(self, plan: Plan) -> None:
        releases = [*self.pool.owners(), *self._seqs] if plan.release_all else plan.releases
        for request_id in releases:
            self.pool.release(request_id)
            self._seqs.pop(request_id, None)

    def _admit(self, admit: Admit) -> None:
        request_id, keys = admit.request_id, admit.prefix_keys
        if request_id in self._seqs:
            raise StepRefused(f"request {request_id} is admitted twice")
        if keys and not self.prefix_caching:
            raise StepRefused(f"request {request_id}: prefix caching is off on rank {self.rank}")
        self.pool.pin(request_id, keys)
        self._admitted.append(request_id)
        self._seqs[request_id] = _Sequence(
            length=len(keys) * self.page_size, committed=len(keys), parent=keys[-1] if keys else None
        )

    def _reserve(self, chunk: Chunk) -> None:
        seq = self._seqs.get(chunk.request_id)
        if seq is None:
            raise StepRefused(f"request {chunk.request_id} is not admitted")
        if chunk.start != seq.length:
            raise StepRefused(
                f"request {chunk.request_id}: chunk starts at {chunk.start} but this rank holds {seq.length} tokens"
            )
        if not chunk.token_ids:
            raise StepRefused(f"request {chunk.request_id}: empty chunk")
        end = chunk.start + len(chunk.token_ids)
        if end > self.max_model_len:
            raise StepRefused(f"request {chunk.request_id}: position {end} is past the model's context")
        need = pages_for(end, self.page_size) - len(self.pool.table(chunk.request_id))
        if need > 0:
            self.pool.allocate(chunk.request_id, need)
