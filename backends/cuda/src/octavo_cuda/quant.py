"""The CUDA backend's kernels for quantization methods (``octavo_quant_kernels``).

``gptq`` and ``awq``: ``int4_matmul`` runs the tensor-core GEMV (``octavo_cuda.int4_mma``) for
the calls it supports (1 to 8 rows, natural-order groups) and returns ``None`` for the rest,
which ``octavo.kernels.int4.int4_linear`` gives to the Triton kernels. On by default
(``OCTAVO_CUDA_INT4_MMA=0`` turns it off, for A/B runs); without NVRTC the Triton kernels run
(logged).
"""

from __future__ import annotations

import logging

import torch
from octavo import envs

logger = logging.getLogger(__name__)

INT4_METHODS = ("gptq", "awq")


class Int4Kernels:
    """What ``int4_linear`` looks for (``int4_matmul``)."""

    @staticmethod
    def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int,
                    g_idx: torch.Tensor | None) -> torch.Tensor | None:
        from octavo_cuda.int4_mma import int4_mma_gemv, supports

        if not supports(x, qweight, scales, zeros, group_size, g_idx):
            return None
        return int4_mma_gemv(x, qweight, scales, zeros, group_size)


def quant_kernels(method: str) -> Int4Kernels | None:
    """The kernels for ``method``, or ``None`` (the method's own Triton/torch paths run)."""
    if method not in INT4_METHODS:
        return None
    if not envs.cuda_int4_mma():
        logger.info("int4 weights: the Triton int4_gemv runs (OCTAVO_CUDA_INT4_MMA=0)")
        return None
    from octavo_cuda.nvrtc import NvrtcError, require_nvrtc

    try:
        require_nvrtc()
    except NvrtcError as exc:
        logger.warning("int4 weights: %s; the Triton int4_gemv runs instead", exc)
        return None
    logger.info("int4 weights: the tensor-core GEMV (octavo_cuda.int4_mma) takes 1 to 8 rows")
    return Int4Kernels()
