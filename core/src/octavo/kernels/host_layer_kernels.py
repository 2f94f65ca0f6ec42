"""Kernels a backend gives the model layers for tensors on a device torch runs on the host
(the CPU), registered by the backend's worker and looked up by the layers at every call.

The CUDA/ROCm layers reach the Triton kernels through ``octavo.kernels.triton_support``; a
host backend has no such shared kernels, so its worker registers its own here
(``register_host_layer_kernels("cpu", ...)``) once they are loaded. A layer whose input lives
on a device with nothing registered runs its ``forward_native`` torch code. Every kernel has
the same contract as the ``forward_native`` it replaces (same results up to float rounding,
inputs left untouched), and each is optional (``None``: that layer keeps its torch code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["HostLayerKernels", "host_layer_kernels", "register_host_layer_kernels"]


@dataclass(frozen=True, slots=True)
class HostLayerKernels:
    """One backend's layer kernels (each ``None`` when it has none for that layer)."""

    # (x, weight, eps) -> RMSNorm(x)                                       (RMSNorm)
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    # (x, residual, weight, eps) -> (RMSNorm(x + residual), x + residual)  (RMSNorm)
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # (positions, query, key, cos_sin_cache) -> rotated (query, key), "neox" halves
    rotary_neox: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # (x [..., 2d]) -> silu(x[..., :d]) * x[..., d:]                       (SiluAndMul)
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None


_registered: dict[str, HostLayerKernels] = {}


def register_host_layer_kernels(device_type: str, kernels: HostLayerKernels | None) -> None:
    """Give the layers ``kernels`` for tensors on ``device_type`` (``None``: take them away,
    the layers' torch code runs again)."""
    if kernels is None:
        _registered.pop(device_type, None)
    else:
        _registered[device_type] = kernels


def host_layer_kernels(device_type: str) -> HostLayerKernels | None:
    """The kernels registered for ``device_type``, if any (a dict lookup: called per layer)."""
    return _registered.get(device_type)
