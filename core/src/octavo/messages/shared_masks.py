"""``SharedMasks``: grammar masks in shared memory, read in place by the processes that map it.

Two buffers of ``max_rows`` rows of ``num_words`` int32 words (``GrammarBitmask``'s layout)
in one file of shared memory without a name (``memfd_create``; an unlinked file in /dev/shm
where there is none). It reaches another process only as an open descriptor, passed when that
process starts, so nothing is left behind however the processes end.

The engine core's grammars (the grammar process, ``octavo.structured_output.process``, or the
manager on the engine core's threads) fill a step's rows into one buffer, the next
constrained step's into the other, and so on in turn. The ``GrammarBitmask`` they return is a
view of those rows that also names its buffer (``shared_buffer``). An
executor whose workers map the same file (``--distributed-executor-backend mp``) sends
``by_reference(bitmask)``: the row ids and the buffer's number, not the rows (~1.5 MB a step
for 256 rows of a 49k vocabulary). Each worker reads them from its own mapping
(``resolve``).

Why two buffers are enough: a buffer is filled again for the constrained step two after the
one that used it, and the engine core starts that work only after it recorded the step in
between. By then every rank has read the older rows: a rank reads a step's rows when it
samples that step, before it launches the next one, and the output rank cannot finish the
next step before every rank has joined that step's collectives.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from multiprocessing import reduction
from typing import Any

import numpy as np

from octavo.messages.scheduler_output import GrammarBitmask


class SharedMasks:
    """The mask buffers, mapped in this process. Pickled, it reaches the child of a
    ``multiprocessing`` spawn as a descriptor of the same file (and works nowhere else)."""

    def __init__(self, fd: int, max_rows: int, num_words: int) -> None:
        """Map the file open as ``fd``; once mapped, this object owns the descriptor."""
        if max_rows < 1 or num_words < 1:
            raise ValueError(f"shared masks need at least one row and word, got {max_rows} "
                             f"rows of {num_words} words")
        self.max_rows = max_rows
        self.num_words = num_words
        self._mmap = mmap.mmap(fd, masks_bytes(max_rows, num_words))
        self._fd = fd
        # Closed once: by close(), or when this object goes.
        self._close_fd = weakref.finalize(self, os.close, fd)
        # [2, max_rows, num_words] int32: the two buffers.
        self.array = np.frombuffer(self._mmap, dtype=np.int32).reshape(2, max_rows, num_words)

    @classmethod
    def create(cls, max_rows: int, vocab_size: int) -> SharedMasks:
        """New buffers for steps of up to ``max_rows`` rows over ``vocab_size`` tokens (the
        pages are allocated as rows are first written)."""
        num_words = (vocab_size + 31) // 32
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("octavo-grammar-masks", os.MFD_CLOEXEC)
        else:
            shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="octavo-grammar-masks-", dir=shm_dir)
            os.unlink(path)
        try:
            os.ftruncate(fd, masks_bytes(max_rows, num_words))
            return cls(fd, max_rows, num_words)
        except BaseException:
            os.close(fd)
            raise

    def fileno(self) -> int:
        """The file's descriptor in this process (to pass to a child as it starts)."""
        return self._fd

    def bitmask(self, buffer: int, req_ids: list[str]) -> GrammarBitmask:
        """The first ``len(req_ids)`` rows of ``buffer`` as a ``GrammarBitmask`` (a view,
        naming its buffer)."""
        data = memoryview(self.array[buffer, :len(req_ids)]).cast("B")
        return GrammarBitmask(req_ids=req_ids, num_words=self.num_words, data=data,
                              shared_buffer=buffer)

    def resolve(self, bitmask: GrammarBitmask) -> GrammarBitmask:
        """``bitmask`` with its rows: as it is when it carries them, else read from this
        file (a ``by_reference`` bitmask). Raises ``ValueError`` for a reference these
        buffers cannot hold."""
        if carries_rows(bitmask):
            return bitmask
        buffer, rows = bitmask.shared_buffer, len(bitmask.req_ids)
        if buffer not in (0, 1) or rows > self.max_rows or bitmask.num_words != self.num_words:
            raise ValueError(f"a grammar bitmask of {rows} rows of {bitmask.num_words} words "
                             f"in buffer {buffer}: the shared masks hold two buffers of "
                             f"{self.max_rows} rows of {self.num_words} words")
        return self.bitmask(buffer, bitmask.req_ids)

    def close(self) -> None:
        """Unmap the buffers and close the descriptor (idempotent). Views still held keep
        the mapping alive until they go."""
        if self._fd < 0:
            return
        self.array = np.empty((2, 0, self.num_words), dtype=np.int32)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive: the mapping goes with the last one
        self._close_fd()
        self._fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inherit, (reduction.DupFd(self._fd), self.max_rows, self.num_words))


def _inherit(dup: Any, max_rows: int, num_words: int) -> SharedMasks:
    return SharedMasks(dup.detach(), max_rows, num_words)


def masks_bytes(max_rows: int, num_words: int) -> int:
    """The file's size: two buffers of ``max_rows`` rows of ``num_words`` int32 words."""
    return 2 * max_rows * num_words * 4


def carries_rows(bitmask: GrammarBitmask) -> bool:
    """Whether ``bitmask.data`` holds its rows (not a reference to shared buffers)."""
    return bitmask.shared_buffer is None or len(bitmask.data) == (
        len(bitmask.req_ids) * bitmask.num_words * 4)


def by_reference(bitmask: GrammarBitmask) -> GrammarBitmask:
    """``bitmask`` without its rows, for a process that maps the same ``SharedMasks``
    (``resolve`` there reads them); as it is when its rows are not in shared buffers."""
    if bitmask.shared_buffer is None or not bitmask.req_ids:
        return bitmask
    return GrammarBitmask(req_ids=bitmask.req_ids, num_words=bitmask.num_words,
                          data=memoryview(b""), shared_buffer=bitmask.shared_buffer)
