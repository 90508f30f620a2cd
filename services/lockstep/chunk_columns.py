"""A step's chunks as columns: how the scheduler builds a plan's batch and a rank holds it.

A plan's batch travels as columns (`BatchMsg`: entry i of each is chunk i), and a rank's step reads
columns: the token ids, table rows, starts and lengths its inputs are built from, the sampling rows, the
tokens its cache takes in. Making a `Chunk` per request and reading it apart again was most of a rank's
host time at batch 256, so `ChunkColumns` keeps the columns, and makes a `Chunk` only for whoever indexes
or iterates it (the tests, the rare paths: prompt scoring, penalties). It is a `Sequence[Chunk]` equal to
the tuple of the same chunks, so a plan holds either, and its users read it alike. The scheduler appends to
one as it plans (a decode planned ahead, `extend_pending`, makes no `Chunk` either) and reads its columns back
when the step's reports are applied.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import Any, overload

from lockstep.steps import PENDING_TOKEN, Chunk, SamplingParams

# a chunk's rare fields, by its index: (prompt_logprobs, next_token_id, history), as Chunk holds them
Extras = tuple[int, int, "tuple[int, ...] | None"]
NO_EXTRAS: Extras = (-1, -1, None)


class _Derived:
    """A value derived from the columns, made on first read and kept until a chunk is appended: a batch read
    while it is still being built (a log line, a check) must not keep what fewer chunks gave. Appends stay
    plain list appends (a plan built ahead makes one per running request); a read checks the length."""

    def __init__(self, make: Callable[[ChunkColumns], Any]) -> None:
        self.make, self.name, self.__doc__ = make, make.__name__, make.__doc__

    def __get__(self, columns: ChunkColumns | None, owner: type | None = None) -> Any:
        if columns is None:
            return self
        n = len(columns.request_ids)
        made = columns.__dict__.get(self.name)
        if made is None or made[0] != n:
            made = columns.__dict__[self.name] = (n, self.make(columns))
        return made[1]

    def __set__(self, columns: ChunkColumns, value: object) -> None:
        raise AttributeError(f"{self.name} is derived from the columns")


class ChunkColumns(Sequence[Chunk]):
    """Entry i of each column is chunk i: `token_ids` holds every chunk's tokens one after another,
    `token_counts[i]` of them chunk i's, and `sampling[i]` is chunk i's parameters (objects shared by the
    chunks whose parameters are equal)."""

    def __init__(self, request_ids: list[str], token_counts: list[int], token_ids: list[int], starts: list[int],
                 sample: list[bool], sample_index: list[int], sampling: list[SamplingParams],
                 extras: dict[int, Extras] | None = None) -> None:
        self.request_ids = request_ids
        self.token_counts = token_counts
        self.token_ids = token_ids
        self.starts = starts
        self.sample = sample
        self.sample_index = sample_index
        self.sampling = sampling
        self.extras = extras or {}

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> ChunkColumns:
        """The chunks' columns; columns already are their own."""
        if isinstance(chunks, ChunkColumns):
            return chunks
        out = cls.empty()
        for c in chunks:
            out.append(c)
        return out

    @classmethod
    def empty(cls) -> ChunkColumns:
        """Columns to build a batch in with `append` and `extend_pending`; read them once it is built."""
        return cls([], [], [], [], [], [], [], {})

    def append(self, c: Chunk) -> None:
        if c.prompt_logprobs != -1 or c.next_token_id != -1 or c.history is not None:
            self.extras[len(self.request_ids)] = (c.prompt_logprobs, c.next_token_id, c.history)
        self.request_ids.append(c.request_id)
        self.token_counts.append(len(c.token_ids))
        self.token_ids.extend(c.token_ids)
        self.starts.append(c.start)
        self.sample.append(c.sample)
        self.sample_index.append(c.sample_index)
        self.sampling.append(c.sampling)

    def extend_pending(self, request_ids: list[str], starts: list[int], sampling: list[SamplingParams],
                       sample_index: list[int]) -> None:
        """Decodes planned ahead, each of the token the step before samples: `append` of each such Chunk, without
        making it (a plan built ahead holds one per running request)."""
        k = len(request_ids)
        if not len(starts) == len(sampling) == len(sample_index) == k:
            raise ValueError(f"{k} request ids, {len(starts)} starts, {len(sampling)} samplings and "
                             f"{len(sample_index)} sample indexes for the same decodes")
        self.request_ids += request_ids
        self.token_counts += [1] * k
        self.token_ids += [PENDING_TOKEN] * k
        self.starts += starts
        self.sample += [True] * k
        self.sample_index += sample_index
        self.sampling += sampling

    def ends(self) -> dict[str, int]:
        """Where each chunk leaves its request (start + its tokens), by request."""
        return dict(zip(self.request_ids, map(operator.add, self.starts, self.token_counts), strict=True))

    @_Derived
    def one_token_each(self) -> bool:
        """Whether every chunk is one token (a decode step): then chunk i's token is token_ids[i]."""
        return not self.token_counts or min(self.token_counts) == 1 == max(self.token_counts)

    @_Derived
    def offsets(self) -> list[int]:
        """Where each chunk's tokens start in `token_ids`, and their end last."""
        return list(accumulate(self.token_counts, initial=0))

    @_Derived
    def distinct_sampling(self) -> list[SamplingParams]:
        """The batch's parameters, each object once (a decode step repeats every request's)."""
        return list(dict(zip(map(id, self.sampling), self.sampling, strict=True)).values())

    def tokens(self, i: int) -> tuple[int, ...]:
        if self.one_token_each:
            return (self.token_ids[i],)
        a, b = self.offsets[i], self.offsets[i + 1]
        return tuple(self.token_ids[a:b])

    def pending(self) -> list[int]:
        """The chunks whose token is the one the step before sampled (overlap), in batch order."""
        return list(self._pending)

    @_Derived
    def _pending(self) -> list[int]:
        """`pending`, made once: a rank's step reads it twice (its tokens, then `resolved`)."""
        if self.one_token_each:
            return [i for i, t in enumerate(self.token_ids) if t == PENDING_TOKEN]
        at = self.offsets
        return [i for i, n in enumerate(self.token_counts) if n == 1 and self.token_ids[at[i]] == PENDING_TOKEN]

    def resolved(self, drawn: Sequence[int]) -> ChunkColumns:
        """These columns with the pending chunks' tokens filled in by `drawn`, in batch order."""
        pending = self.pending()
        if len(pending) != len(drawn):
            raise ValueError(f"{len(drawn)} tokens for {len(pending)} pending chunks")
        if not pending:
            return self
        if len(pending) == len(self.token_ids):  # every chunk one pending token (a decode step with overlap)
            return ChunkColumns(self.request_ids, self.token_counts, list(drawn), self.starts, self.sample,
                                self.sample_index, self.sampling, self.extras)
        tokens = list(self.token_ids)
        at = None if self.one_token_each else self.offsets
        for i, token in zip(pending, drawn, strict=True):
            tokens[i if at is None else at[i]] = token
        return ChunkColumns(self.request_ids, self.token_counts, tokens, self.starts, self.sample,
                            self.sample_index, self.sampling, self.extras)

    def chunk(self, i: int) -> Chunk:
        """Chunk i, made from the columns."""
        return Chunk(self.request_ids[i], self.tokens(i), self.starts[i], self.sample[i], self.sampling[i],
                     self.sample_index[i], *self.extras.get(i, NO_EXTRAS))

    def __len__(self) -> int:
        return len(self.request_ids)

    @overload
    def __getitem__(self, i: int) -> Chunk: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Chunk, ...]: ...

    def __getitem__(self, i: int | slice) -> Chunk | tuple[Chunk, ...]:
        if isinstance(i, slice):
            return tuple(self.chunk(j) for j in range(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"chunk {i} of {len(self)}")
        return self.chunk(i % len(self))

    def __iter__(self) -> Iterator[Chunk]:
        return (self.chunk(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkColumns | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        """As the tuple of its chunks': an empty batch hashes, a chunk does not."""
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkColumns({tuple(self)!r})"
