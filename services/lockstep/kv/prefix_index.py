"""The prefix index of one KV pool: which page holds the contents named by each page key.

Keys are a hash chain (see page_keys), so a key already names its position; the index is a flat pair of
maps, and a probe walks a chain's keys from the first page and stops at the first key it does not hold.
It never answers past a gap: a rank that matched page 3 but not page 2 holds a prefix of two pages.
The index knows nothing of references or eviction order; the allocator owns those.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class PrefixIndex:
    """Bijection between page keys and the pages that hold them."""

    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._page_of)

    def __contains__(self, key: object) -> bool:
        return key in self._page_of

    def page_of(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def key_of(self, page: int) -> bytes | None:
        return self._key_of.get(page)

    def insert(self, key: bytes, page: int) -> bool:
        """Index `page` under `key`. False if the key already names another page (nothing changes)."""
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"page key must be non-empty bytes, got {key!r:.80}")
        held = self._page_of.get(key)
        if held is not None:
            return held == page
        old = self._key_of.get(page)
        if old is not None:
            raise ValueError(f"page {page} is already indexed under another key ({old.hex()[:16]}...)")
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def remove(self, page: int) -> bytes:
        """Drop `page` from the index and return the key it held."""
        key = self._key_of.pop(page, None)
        if key is None:
            raise KeyError(f"page {page} is not indexed")
        del self._page_of[key]
        return key

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the leading keys the index holds, stopping at the first miss; O(pages matched)."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter(self._page_of.items())

    def check(self) -> None:
        """Raise AssertionError unless the two maps are inverse of each other."""
        if len(self._page_of) != len(self._key_of):
            raise AssertionError(
                f"index maps differ in size: {len(self._page_of)} keys, {len(self._key_of)} pages"
            )
        for key, page in self._page_of.items():
            if self._key_of.get(page) != key:
                raise AssertionError(f"index maps disagree on page {page}")
