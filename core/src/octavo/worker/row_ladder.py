"""Row counts of a step's GEMMs rounded up to a ladder of sizes (GPU workers).

cuBLAS (and hipBLASLt) pick a kernel the first time they see a GEMM shape, and on the H100
that choice costs 0.2 to 6 ms of host time per shape (docs/benchmarks.md, "The LM head's row
count" and "The eager steps' token counts"), after which a launch costs ~20-30 µs. Two row
counts change nearly every step:

- the LM head's, the number of rows a step samples (requests finish and arrive): rounded up to
  the ladder and warmed at start-up, the head runs a handful of shapes; padding rows are
  zeros and their logits are dropped (``padded_logits``, ``warm_up_logits``);
- an eager (prompt or mixed) step's token count, which every projection of the model has as
  its row count: rounded up too (``pad_step``), with padding tokens that are inert as in the
  CUDA graphs' padding (slot ``-1``, no cache write, in no sequence), their hidden states cut
  off. Not warmed: there are ~100 sizes up to an 8,192-token budget; each is paid once per
  process instead of every new count.

The ladder is explicit up to its top (the decode graphs' batch sizes), then geometric: a count
past the top is rounded up to a multiple of 1/16 of its power of two, so padding stays below
1/16 of the rows. The CPU worker does not pad: there a padding row costs its arithmetic, and
the CPU's BLAS picks no kernel per shape.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from octavo.attention.base import AttentionMetadata
from octavo.kernels.argmax import argmax_rows

logger = logging.getLogger(__name__)

# Past the ladder's top, counts are rounded up to a multiple of 2**(floor(log2(rows)) - this).
GEOMETRIC_STEPS_LOG2 = 4


class RowLadder:
    """The padded row count of a GEMM (``padded``), from sorted explicit ``sizes``."""

    def __init__(self, sizes: Sequence[int]) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"a row ladder needs positive sizes, got {list(sizes)}")
        self.sizes = sorted(set(sizes))

    def padded(self, rows: int) -> int:
        """The smallest ladder size >= ``rows``; past the top, ``rows`` rounded up to a
        multiple of ``2 ** (floor(log2(rows)) - 4)`` (less than 1/16 more). ``padded(0)``
        is 0."""
        if rows <= 0:
            return rows
        index = bisect.bisect_left(self.sizes, rows)
        if index < len(self.sizes):
            return self.sizes[index]
        step = 1 << max(0, rows.bit_length() - 1 - GEOMETRIC_STEPS_LOG2)
        return -(-rows // step) * step


def padded_logits(ladder: RowLadder, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                  hidden: torch.Tensor) -> torch.Tensor:
    """``compute_logits(hidden)`` run on ``hidden``'s rows padded with zeros to the ladder;
    the padding rows' logits are cut off again (a view of the first rows)."""
    rows = hidden.shape[0]
    padded = ladder.padded(rows)
    if padded == rows:
        return compute_logits(hidden)
    return compute_logits(F.pad(hidden, (0, 0, 0, padded - rows)))[:rows]


def warm_up_logits(ladder: RowLadder, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                   hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Run the LM head once at every explicit ladder size, so that no step pays the BLAS
    library's first call of those shapes, and the greedy argmax after it (its Triton
    kernels compile on first use)."""
    start = time.perf_counter()
    hidden = torch.zeros(ladder.sizes[-1], hidden_size, dtype=dtype, device=device)
    for rows in ladder.sizes:
        argmax_rows(compute_logits(hidden[:rows]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("LM head and greedy argmax warmed at %d row counts (%s..%s) in %.2f s",
                len(ladder.sizes), ladder.sizes[0], ladder.sizes[-1],
                time.perf_counter() - start)


def pad_step(ladder: RowLadder, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: AttentionMetadata
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's flat inputs with inert padding tokens appended up to the ladder: token 0 at
    position 0, slot ``-1`` (no cache write), in no sequence (``query_start_loc`` and
    ``seq_lens`` unchanged), so the attention kernels skip them as they skip a CUDA graph's
    padding. Unchanged when the count is on the ladder. The caller cuts the hidden states
    back to ``metadata.num_tokens`` rows."""
    tokens = metadata.num_tokens
    pad = ladder.padded(tokens) - tokens
    if pad == 0:
        return input_ids, positions, metadata
    return (F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)),
            dataclasses.replace(metadata, num_tokens=tokens + pad,
                                slot_mapping=F.pad(metadata.slot_mapping, (0, pad), value=-1)))
