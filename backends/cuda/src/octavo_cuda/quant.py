"""The CUDA backend's kernels for quantization methods (``octavo_quant_kernels``).

``gptq`` and ``awq``: ``int4_matmul`` runs the tensor-core GEMV (``octavo_cuda.int4_mma``) for
the calls it supports (1 to 8 rows, natural-order groups) and returns ``None`` for the rest,
which ``octavo.kernels.int4.int4_linear`` gives to the Triton kernels. On by default
(``OCTAVO_CUDA_INT4_MMA=0`` turns it off, for A/B runs); without NVRTC the Triton kernels run
(logged). ``int4_prepare_qweight`` rearranges the words of the layers that GEMV takes into
32-output panels at load (``octavo.kernels.int4.to_panels``; ``OCTAVO_CUDA_INT4_PANELS=0``
keeps GPTQ's rows, for A/B runs): each block then reads a group's words as one contiguous
run. The Triton kernels read panels too, for prompts and act-order layers.
``int4_matmul_add_rms_norm`` runs one row's RMS norm inside the GEMV after it
(``int4_mma_gemv_add_rms_norm``; ``OCTAVO_CUDA_INT4_NORM=0`` turns it off, for A/B runs).
"""

from __future__ import annotations

import logging

import torch
from octavo import envs
from octavo.kernels.int4 import PANEL, to_panels

logger = logging.getLogger(__name__)

INT4_METHODS = ("gptq", "awq")


class Int4Kernels:
    """What the int4 methods look for: ``int4_matmul`` (``int4_linear``, every matmul),
    ``int4_matmul_add_rms_norm`` (``Int4LinearMethod.apply_add_rms_norm``: a norm, then the
    matmul; only with ``fused_norm``) and ``int4_prepare_qweight`` (once per layer, at
    load)."""

    def __init__(self, fused_norm: bool = False) -> None:
        self.fused_norm = fused_norm

    @staticmethod
    def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int,
                    g_idx: torch.Tensor | None) -> torch.Tensor | None:
        from octavo_cuda.int4_mma import int4_mma_gemv, supports

        if not supports(x, qweight, scales, zeros, group_size, g_idx):
            return None
        return int4_mma_gemv(x, qweight, scales, zeros, group_size)

    def int4_matmul_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
        qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
        g_idx: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rms_norm(x + residual) * norm_weight @ W^T, x + residual)`` in one kernel for one
        row the GEMV takes; ``None`` otherwise (the norm kernel runs, then ``int4_matmul``)."""
        from octavo_cuda.int4_mma import int4_mma_gemv_add_rms_norm, norm_supported, supports

        if not self.fused_norm or not supports(x, qweight, scales, zeros, group_size, g_idx) \
                or not norm_supported(x, residual, norm_weight):
            return None
        return int4_mma_gemv_add_rms_norm(x, residual, norm_weight, eps, qweight, scales, zeros,
                                          group_size)

    @staticmethod
    def int4_prepare_qweight(qweight: torch.Tensor, group_size: int,
                             g_idx: torch.Tensor | None) -> torch.Tensor:
        """``qweight`` in 32-output panels when the tensor-core GEMV takes its layer (groups
        of 32-128 in natural order, N a multiple of 32, fewer than 2^31 words), else as is."""
        from octavo_cuda.int4_mma import GROUP_SIZES

        if not envs.cuda_int4_panels() or g_idx is not None or group_size not in GROUP_SIZES \
                or qweight.dim() != 2 or qweight.shape[1] % PANEL or qweight.numel() >= 2**31:
            return qweight
        return to_panels(qweight)


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
    fused_norm = envs.cuda_int4_norm()
    logger.info("int4 weights: the tensor-core GEMV (octavo_cuda.int4_mma) takes 1 to 8 rows%s",
                ", with the RMS norm before it at one row" if fused_norm
                else " (OCTAVO_CUDA_INT4_NORM=0: the RMS norms run as their own kernels)")
    return Int4Kernels(fused_norm)
