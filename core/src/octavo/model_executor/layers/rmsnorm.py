"""Root-mean-square layer norm, optionally fused with the residual add before it.

On CUDA tensors ``RMSNorm`` runs the Triton kernels of ``octavo.kernels.triton.rmsnorm`` (one
launch instead of ~8 eager ops); on a host device the backend's kernels where it registered
them (``octavo.kernels.host_layer_kernels``: the CPU backend's C++ op); elsewhere
``forward_native``.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.kernels.host_layer_kernels import host_layer_kernels
from octavo.kernels.triton_support import optional_triton_kernels


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in float32.

    Matches Hugging Face's ``LlamaRMSNorm``: the normalisation runs in float32, the result is
    cast back to the input dtype and then scaled by ``weight``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Return ``norm(x)``; with ``residual``, return ``(norm(x + residual), x + residual)``.

        CUDA tensors go through the fused Triton kernel (same math, see
        ``octavo.kernels.triton.rmsnorm``), others through ``forward_native``.
        """
        if not x.is_cuda:
            host = host_layer_kernels(x.device.type)
            if host is not None and self.weight.dtype == x.dtype:
                if residual is None and host.rms_norm is not None:
                    return host.rms_norm(x, self.weight, self.eps)
                if residual is not None and host.fused_add_rms_norm is not None:
                    return host.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return self.forward_native(x, residual)
        kernels = optional_triton_kernels("rmsnorm")
        if kernels is None:
            return self.forward_native(x, residual)
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_native(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with torch ops only (the CPU path and the kernels' reference)."""
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, all in float32, then cast back.

    Matches Hugging Face's ``Gemma2RMSNorm``/``Gemma3RMSNorm``: the weight is stored as an
    offset from 1 (initialised to 0), and the product is taken in float32 before the cast
    (Llama casts first, then multiplies). With ``residual`` it returns
    ``(norm(x + residual), x + residual)``, the sum in the input dtype, like ``RMSNorm``.
    Torch ops on every device (no fused kernel of its own yet).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(torch.float32))).to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed
