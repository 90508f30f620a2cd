"""Prompt pages that a running request is computing right now: wait for them rather than compute them twice.

The ranks commit a page into their prefix index only after the step that fills it, so requests with the
same prompt admitted together (the n choices of one request, identical concurrent prompts) would each
compute all of it. Instead, a waiting request whose leading full pages some running request has still to
compute is held back until those pages are committed; it is then probed and admitted with the prefix
every rank agreed on, as any request is, and computes only the rest. A held request keeps its place in
the queue, and the requests behind it may be admitted meanwhile.

Page keys are a hash chain, so two requests share page j exactly when their j-th keys are equal, and then
share every page before it: comparing the one page a running request computes next decides it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lockstep.coordinator.request import Request

PREFIX_PENDING = "prefix_pending"  # the deferral reason of a held request (lockstep_admission_deferred_total)


def computing_sibling(
    req: Request,
    running: Iterable[Request],
    pages: int,
    page_size: int,
    salt: bytes,
    computed: Mapping[str, int] | None = None,
) -> Request | None:
    """A running request that has still to compute one of the first `pages` full pages of `req`'s tokens
    (the pages `req` would probe; 0: none), or None when no such request holds `req` back.

    `computed[rid]` overrides a running request's `num_computed`: the positions it will hold once the plan
    being built has run, to tell whether `req` is still held after this step (and so not worth probing).
    A request that was preempted, aborted or has finished is not running, so it holds nobody back.
    """
    if pages <= 0:
        return None
    for other in running:
        if other is req:
            continue
        done = other.num_computed if computed is None else computed.get(other.request_id, other.num_computed)
        page = done // page_size  # the first page it has not filled yet
        if page >= pages or (page + 1) * page_size > other.num_tokens:
            continue
        if req.page_key(page, page_size, salt) == other.page_key(page, page_size, salt):
            return other
    return None
