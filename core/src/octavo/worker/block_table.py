"""The model runner's block tables, kept in one persistent array across steps.

Every step needs a ``[num_seqs, max_blocks]`` table of the scheduled requests' KV block ids.
Rebuilding it from Python lists costs a list-to-array copy per request per step (about half a
millisecond at 256 requests); here each request owns a row of a persistent ``int32`` array
that changes only when the request gains blocks, and a step's table is one gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    """Rows of block ids, one per live request; unused entries are 0.

    Contract: ``add_row`` gives a row holding the given ids; ``append`` extends a row;
    ``free_row`` returns it (zeroed) for reuse; ``gather(rows, width)`` returns a fresh
    ``[len(rows), width]`` array, row ``i`` holding ``rows[i]``'s ids then zeros. Rows and
    columns grow on demand.
    """

    def __init__(self, num_rows: int = 64, num_cols: int = 64) -> None:
        if num_rows < 1 or num_cols < 1:
            raise ValueError(f"BlockTable needs at least one row and column, got {num_rows}x{num_cols}")
        self._table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self._lengths = np.zeros(num_rows, dtype=np.int64)
        # Free rows, the lowest on top (so live rows stay packed at the front).
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_live_rows(self) -> int:
        return len(self._lengths) - len(self._free)

    def add_row(self, block_ids: Sequence[int]) -> int:
        """A new row holding ``block_ids``; returns its index."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._lengths[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        """Add ``block_ids`` at the end of ``row``."""
        if not block_ids:
            return
        start = int(self._lengths[row])
        end = start + len(block_ids)
        if end > self._table.shape[1]:
            self._grow_cols(end)
        self._table[row, start:end] = block_ids
        self._lengths[row] = end

    def replace(self, row: int, index: int, block_id: int) -> None:
        """Put ``block_id`` at position ``index`` of ``row`` (a block copied on write)."""
        assert index < self._lengths[row], f"row {row} has no block at {index}"
        self._table[row, index] = block_id

    def free_row(self, row: int) -> None:
        """Give ``row`` back; its entries are zeroed so a later owner starts clean."""
        self._table[row, : self._lengths[row]] = 0
        self._lengths[row] = 0
        self._free.append(row)

    def gather(self, rows: Sequence[int], width: int) -> np.ndarray:
        """The ``[len(rows), width]`` table of ``rows`` (a copy), for one step."""
        if width > self._table.shape[1]:
            self._grow_cols(width)
        return self._table[np.asarray(rows, dtype=np.intp), :width]

    def block_ids_at(self, rows: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Entry ``indices[i]`` of row ``rows[i]``, for every ``i`` (each within its row)."""
        return self._table[rows, indices]

    def num_blocks(self, rows: np.ndarray) -> np.ndarray:
        """How many block ids each of ``rows`` holds (int64, a copy)."""
        return self._lengths[rows]

    def max_num_blocks(self, rows: np.ndarray) -> int:
        """The most block ids any of ``rows`` holds."""
        return int(self._lengths[rows].max())

    def _grow_rows(self) -> None:
        old = len(self._lengths)
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._lengths = np.concatenate([self._lengths, np.zeros_like(self._lengths)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_cols(self, needed: int) -> None:
        cols = self._table.shape[1]
        while cols < needed:
            cols *= 2
        grown = np.zeros((self._table.shape[0], cols), dtype=np.int32)
        grown[:, : self._table.shape[1]] = self._table
        self._table = grown
