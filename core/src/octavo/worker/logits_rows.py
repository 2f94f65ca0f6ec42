"""The LM head's row count rounded up to a short ladder of sizes (GPU workers).

cuBLAS (and hipBLASLt) pick a kernel the first time they see a GEMM shape, and on the H100 that
choice costs 0.2 to 6 ms of host time for an LM head (49k to 152k rows of 896 to 4,096; see
docs/benchmarks.md, "The LM head's row count"). The head's row count is the number of rows a
step samples, which changes nearly every step as requests finish and arrive, so an unpadded
head paid that cost on most steps of a fresh process: a decode step's host work is what paces
it. Rounded up to a ladder whose sizes are each warmed once at start-up, the head runs a
handful of shapes; the padding rows are zeros and their logits are dropped.

The CPU worker does not pad: there a padding row costs a row's arithmetic, and the CPU's BLAS
picks no kernels by shape.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Past the ladder's top (e.g. speculative decoding's 1 + k rows per sequence), row counts are
# rounded up to a multiple of this.
ROW_ALIGNMENT = 64


class LogitsRowLadder:
    """The padded row count of every LM-head call (``padded``), from sorted ``sizes``."""

    def __init__(self, sizes: Sequence[int]) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"a logits row ladder needs positive sizes, got {list(sizes)}")
        self.sizes = sorted(set(sizes))

    def padded(self, rows: int) -> int:
        """The smallest ladder size >= ``rows``; past the top, ``rows`` rounded up to a
        multiple of ``ROW_ALIGNMENT``. ``padded(0) == 0``."""
        if rows <= 0:
            return rows
        index = bisect.bisect_left(self.sizes, rows)
        if index < len(self.sizes):
            return self.sizes[index]
        return -(-rows // ROW_ALIGNMENT) * ROW_ALIGNMENT

    def logits(self, compute_logits: Callable[[torch.Tensor], torch.Tensor],
               hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits(hidden)`` run on ``hidden``'s rows padded with zeros to the
        ladder; the padding rows' logits are cut off again (a view of the first rows)."""
        rows = hidden.shape[0]
        padded = self.padded(rows)
        if padded == rows:
            return compute_logits(hidden)
        return compute_logits(F.pad(hidden, (0, 0, 0, padded - rows)))[:rows]

    def warm_up(self, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Run the LM head once at every ladder size, so that no step pays the BLAS
        library's first-call cost of a shape."""
        start = time.perf_counter()
        hidden = torch.zeros(self.sizes[-1], hidden_size, dtype=dtype, device=device)
        for rows in self.sizes:
            compute_logits(hidden[:rows])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        logger.info("LM head warmed at %d row counts (%s..%s) in %.2f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)
