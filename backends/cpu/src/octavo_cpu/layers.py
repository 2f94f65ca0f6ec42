"""The CPU backend's kernels for the model layers' small ops (``csrc/layer_ops.cpp``): fused
residual add + RMSNorm, rotary embedding and SiLU-and-mul, one C++ call each instead of 3-15
torch dispatches. At batch 1 a decode step of a small model is ~30 layers of vectors of a few
hundred values, where those dispatches cost more than the arithmetic.

:func:`register_layer_kernels` (called by the CPU worker once its threads are set) hands them
to the layers through ``octavo.kernels.host_layer_kernels``; without the C++ kernels, or with
``OCTAVO_CPU_LAYER_KERNELS=0``, nothing is registered and the layers run their torch code.
"""

from __future__ import annotations

import logging

from octavo import envs
from octavo.kernels.host_layer_kernels import HostLayerKernels, register_host_layer_kernels

from octavo_cpu.kernels import load_kernels

logger = logging.getLogger("octavo.cpu.layers")  # under the octavo tree


def layer_kernels() -> HostLayerKernels | None:
    """The C++ layer ops as the layers call them, or ``None`` where they cannot be had."""
    kernels = load_kernels()
    if kernels is None or kernels.rms_norm_op is None:
        return None
    return HostLayerKernels(
        rms_norm=kernels.rms_norm_op,
        fused_add_rms_norm=kernels.fused_add_rms_norm_op,
        rotary_neox=kernels.rotary_neox_op,
        silu_and_mul=kernels.silu_and_mul_op,
    )


def register_layer_kernels() -> bool:
    """Register the C++ layer ops for CPU tensors (or withdraw them with
    ``OCTAVO_CPU_LAYER_KERNELS=0``); whether they are registered."""
    kernels = layer_kernels() if envs.cpu_layer_kernels() else None
    register_host_layer_kernels("cpu", kernels)
    if kernels is None and envs.cpu_layer_kernels():
        return False  # the kernel loader has said why once
    logger.debug("cpu layers: C++ RMSNorm/rotary/SiLU ops %s", "on" if kernels else "off")
    return kernels is not None
