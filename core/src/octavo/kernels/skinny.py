"""When a quantized linear layer runs its memory-bound small-M ("skinny") kernel.

A decode step multiplies few rows (one per running sequence) by the whole weight: the time is
the weight read, so the fp8 and int4 layers switch to GEMV-like Triton kernels
(``octavo.kernels.triton.fp8_gemv``, ``octavo.kernels.triton.int4_gemv``) that read the
quantized weight once and dequantize it in registers, when the number of rows is at most
``SMALL_M_MAX``. Above it the tile GEMMs (``torch._scaled_mm``, ``int4_gemm``) are compute
efficient and the weight read is amortised over the rows.

Importable without Triton: the layers ask ``use_small_m_kernel`` before importing kernels.
"""

from __future__ import annotations

#: Largest number of rows (tokens) the small-M kernels take. 16 is one tensor-core tile of
#: rows: up to it the tile GEMMs waste most of each tile, and the skinny kernels' ``tl.dot``
#: over a 16-row block costs the same as over one row.
SMALL_M_MAX = 16


def use_small_m_kernel(num_rows: int) -> bool:
    """Whether ``num_rows`` rows go through the small-M kernels (``0 < num_rows <=
    SMALL_M_MAX``)."""
    return 0 < num_rows <= SMALL_M_MAX


def m_bucket(num_rows: int) -> int:
    """The row-count bucket launch configs are tuned for: 1, 2, 4, 8 or 16 (the next power of
    two, at most ``SMALL_M_MAX``)."""
    if not use_small_m_kernel(num_rows):
        raise ValueError(f"{num_rows} rows: the small-M kernels take 1 to {SMALL_M_MAX}")
    bucket = 1
    while bucket < num_rows:
        bucket *= 2
    return bucket
