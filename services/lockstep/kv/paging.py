"""Page arithmetic: which pages hold which positions. One home, so the coordinator's admission, the rank's
bookkeeping and the attention batch can never count a sequence's pages differently.

Page i of a sequence holds positions [i * page_size, (i + 1) * page_size).
"""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages holding positions [0, num_tokens)."""
    return -(-num_tokens // page_size)


def growth_pages(num_computed: int, num_tokens: int, page_size: int) -> int:
    """New pages a sequence holding num_computed positions needs to compute num_tokens more."""
    return pages_for(num_computed + num_tokens, page_size) - pages_for(num_computed, page_size)


POOL_FULL, POOL_SLIDING = "full", "sliding"


def first_page(position: int, window: int | None, page_size: int) -> int:
    """The first page a query at `position` reads in a pool of this window (None: a full pool, page 0).

    A sliding layer's query at p sees keys in (p - window, p], so a page wholly before p - window + 1 is
    never read again once the sequence has reached p.
    """
    if not window:
        return 0
    return max(0, position - window + 1) // page_size


def held_pages(num_positions: int, window: int | None, page_size: int) -> int:
    """Pages a sequence of num_positions holds between steps in a pool of this window."""
    return pages_for(num_positions, page_size) - first_page(num_positions, window, page_size)


def peak_pages(window: int | None, page_size: int, max_positions: int) -> int:
    """The most pages one request must hold at once in a pool of this window to make progress (one token
    at a time): its whole context in a full pool, its window and the page being written in a sliding one."""
    whole = pages_for(max_positions, page_size)
    return whole if not window else min(whole, pages_for(window, page_size) + 1)


def pool_window(pool: str, window: int) -> int | None:
    """The window of the named pool in a group whose sliding window is `window` tokens (0: none)."""
    return window if pool == POOL_SLIDING and window else None
