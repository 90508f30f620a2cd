"""Overlap scheduling: the plan of step k+1, built while the ranks still run step k.

The plan in flight is known, its outcome is not: every request it samples for will hold one more token
whose value only its report tells. A plan built ahead names that token as pending (Chunk.pending: each rank
takes the token the sampling rank drew, shared once the group agreed to run the step) and counts pages as if
step k took everything it may take and freed nothing. Here the running requests are carried on; probes and
admissions with no prefix to pin are the scheduler's (`Scheduler.plan_ahead`), and prefix pins (whose answers
must come from the step just before), preemptions and rebalances (which need the ranks' latest counts) wait
for a plan built from the reports. So every decision is still made once, by the coordinator, from the reports
of all ranks; a request that step k ends (a stop token, a cancellation) costs one wasted decode at most, whose
token is never sent.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from lockstep.chunk_columns import ChunkColumns
from lockstep.coordinator.admission import AdmissionControl
from lockstep.coordinator.request import Request
from lockstep.steps import Plan


def chunks_ahead(running: Sequence[Request], in_flight: Plan, control: AdmissionControl) -> ChunkColumns | None:
    """The next chunk of each running request after the plan in flight, its pages taken from `control` (which
    holds what that plan takes already); None when some request could not grow, since only a plan built
    from the reports may preempt.

    Most of them are a decode of the token the plan in flight samples (within the pages the request holds, or into
    a new one): those are gathered in runs, appended as columns (`extend_pending`) before any other chunk is and at
    the end, a few list operations a run and one run in a plain decode step."""
    cols = ChunkColumns.of(in_flight.batch)
    flying = dict(zip(cols.request_ids, zip(map(operator.add, cols.starts, cols.token_counts), cols.sample,
                                            strict=True), strict=True))  # where each leaves its request
    batch = ChunkColumns.empty()
    ids, starts, samplings, indexes = [], [], [], []  # a run of pending decodes, appended to `batch` at its end
    in_page = control.grow_in_page
    for req in running:
        rid = req.request_id
        start, pending = flying.get(rid) or (req.num_computed, False)
        generated = len(req.generated)
        if pending:
            if generated + 1 >= req.max_tokens:
                continue  # the plan in flight samples its last token
            if start == len(req.prompt_token_ids) + generated and in_page(start):  # most of them
                ids.append(rid)
                starts.append(start)
                samplings.append(req.sampling)
                indexes.append(generated + 1)
                continue
        left = req.num_tokens + pending - start
        if left <= 0:
            continue
        n = control.grow(start, left)
        if pending and n == 1 and start == req.num_tokens:  # the token the plan in flight samples, pages counted
            ids.append(rid)
            starts.append(start)
            samplings.append(req.sampling)
            indexes.append(generated + 1)
        elif n:
            if ids:
                batch.extend_pending(ids, starts, samplings, indexes)
                ids, starts, samplings, indexes = [], [], [], []
            batch.append(req.chunk(n, start, pending))
        elif control.tokens_left > 0:
            return None
    if ids:
        batch.extend_pending(ids, starts, samplings, indexes)
    return batch
