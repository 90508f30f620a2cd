"""Every live request's pages of one KV pool, kept as rows of one flat array (vLLM's BlockTable).

A step's attention inputs are index arithmetic on this array (`AttentionBatch.from_table`) instead of a page
table per request copied and flattened on every step: at batch 256 that copy was most of a rank's host
time. `RankCache` writes a row only when its request's pages change (an admit's pins, a chunk's new pages,
pages a sliding window moved past), which is once every `page_size` tokens of a decode.

Row r, column i holds the page of positions [i * page_size, (i + 1) * page_size) of the request in row r; -1
where the request holds no page (not yet, or a window moved past it). Columns past a request's pages may
hold a former owner's pages: readers take a row only as far as its sequence reaches.

The array is never resized in place: a torch tensor made on it with `torch.frombuffer` would keep pointing
at the old memory. Growing makes a new array (`data` is then a new object), so a reader that wraps it
checks `data is` what it wrapped.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

NO_PAGE = -1
TYPECODE = "i"  # int32, as vLLM's block tables: half the bytes of int64, and page ids are far below 2**31


class BlockTable:
    """Rows of page ids (int32), one per live request; as many rows as requests were live at once, and as many
    columns as the longest of them needed (both grow, so a long max_model_len reserves nothing up front)."""

    def __init__(self, rows: int = 16, cols: int = 64) -> None:
        if cols < 1 or rows < 1:
            raise ValueError(f"a block table needs at least one row and one column, got {rows} x {cols}")
        self.rows, self.cols = rows, cols
        self.data = array(TYPECODE, [NO_PAGE]) * (rows * cols)

    def grow(self, rows: int, cols: int = 0) -> None:
        """At least `rows` rows and `cols` columns: a new array (each at least doubled), the old rows copied in."""
        if rows <= self.rows and cols <= self.cols:
            return
        new_rows = max(rows, 2 * self.rows) if rows > self.rows else self.rows
        new_cols = max(cols, 2 * self.cols) if cols > self.cols else self.cols
        data = array(TYPECODE, [NO_PAGE]) * (new_rows * new_cols)
        for r in range(self.rows):
            data[r * new_cols: r * new_cols + self.cols] = self.data[r * self.cols: (r + 1) * self.cols]
        self.data, self.rows, self.cols = data, new_rows, new_cols

    def write(self, row: int, col: int, pages: Sequence[int]) -> None:
        """Pages of row `row` from column `col` on."""
        if not pages:
            return
        if not 0 <= row < self.rows or col < 0:
            raise IndexError(f"block table of {self.rows} rows: cannot write at row {row}, column {col}")
        self.grow(self.rows, col + len(pages))
        at = row * self.cols + col
        self.data[at: at + len(pages)] = array(TYPECODE, pages)

    def clear(self, row: int, col: int, n: int) -> None:
        """No page in columns [col, col + n) of `row` (a window moved past them, or a row handed out anew)."""
        self.write(row, col, [NO_PAGE] * min(n, self.cols - col))

    def page(self, row: int, col: int) -> int:
        """The page at column `col` of `row` (-1: none)."""
        return self.data[row * self.cols + col] if 0 <= col < self.cols else NO_PAGE

    def row(self, row: int, cols: int) -> list[int]:
        """The first `cols` columns of `row` (-1 past the table's columns)."""
        at = row * self.cols
        return self.data[at: at + min(cols, self.cols)].tolist() + [NO_PAGE] * max(0, cols - self.cols)
