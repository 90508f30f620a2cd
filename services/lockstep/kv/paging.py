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
