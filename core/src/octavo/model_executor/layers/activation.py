"""Gated activations of the feed-forward block.

On CUDA tensors ``SiluAndMul`` runs the Triton kernel of ``octavo.kernels.triton.activation``
(one launch instead of three eager ops); on a host device the backend's kernel where it
registered one (``octavo.kernels.host_layer_kernels``); elsewhere ``forward_native``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.kernels.host_layer_kernels import host_layer_kernels
from octavo.kernels.triton_support import optional_triton_kernels


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input holds ``[gate | up]`` along its last dimension.

    Takes the output of a merged gate/up projection, so the MLP needs one matmul for both.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        if not x.is_cuda:
            host = host_layer_kernels(x.device.type)
            if host is not None and host.silu_and_mul is not None:
                return host.silu_and_mul(x)
            return self.forward_native(x)
        kernels = optional_triton_kernels("activation")
        if kernels is None:
            return self.forward_native(x)
        return kernels.silu_and_mul(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        """``forward`` with torch ops only (the CPU path and the kernel's reference)."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` where the input holds ``[gate | up]`` along its last dimension
    (Gemma's MLP; ``approximate="tanh"`` is transformers' ``gelu_pytorch_tanh``)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
