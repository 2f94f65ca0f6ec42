"""Matmuls on weights kept in their GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), on the CPU.

``gguf_matmul(x, blocks, qtype, in_features)`` computes ``x @ W.T`` where ``W`` is never
expanded: ``blocks`` holds each output feature's row of GGUF blocks as raw bytes, exactly as in
the file. The activations are quantized per row and per 32 values to int8 (scale = max|x| /
127), and every 32 values of a weight row meet their 32 activations in one integer dot product
(AVX2 ``vpmaddubsw``/``vpmaddwd``, or AVX-512 VNNI ``vpdpbusd``), scaled in float32. Threads
(torch's, ``torch.set_num_threads``) split the output features. The C++ kernels are in
``csrc/quant_*.cpp``; the block layouts and the math are described in ``csrc/quant_common.h``.

The result differs from ``x @ dequantize(blocks).T`` by the int8 rounding of the activations
only (about 0.3 % of a typical output); ``octavo_cpu.quant_reference`` computes both exactly in
torch, and the tests hold the kernels to it.

Where the C++ kernels cannot be had (no compiler, not x86-64 with AVX2) both functions fall
back to the torch reference (``dequantize`` then a float matmul: correct, slower), after one
warning from the kernel loader.

:func:`quant_kernels` is the CPU backend's answer to ``octavo_quant_kernels``: for the ``gguf``
quantization method it gives :class:`GGUFQuantKernels`, whose ``gguf_matmul`` and
``gguf_dequantize`` the method's layers (linear layers, the token embedding and LM head) call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from octavo import envs
from octavo.kernels.gguf import dequantize_rows, gguf_matmul_reference

from octavo_cpu import quant_reference
from octavo_cpu.kernels import CPUKernels, load_kernels
from octavo_cpu.quant_reference import BLOCK_LAYOUTS, QTYPES, row_bytes

__all__ = [
    "BLOCK_LAYOUTS",
    "QTYPES",
    "GGUFQuantKernels",
    "dequantize",
    "gguf_matmul",
    "kernels_available",
    "quant_kernels",
    "row_bytes",
]

logger = logging.getLogger(__name__)

# The C++ ops' qtype codes (csrc/quant_common.h, QType).
_QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4}
# Activation dtypes the C++ op takes.
_OP_DTYPES = (torch.float32, torch.bfloat16)


def _kernels() -> CPUKernels | None:
    kernels = load_kernels()
    if kernels is None or not kernels.quant_isas:
        return None
    return kernels


def kernels_available() -> bool:
    """Whether the C++ GGUF matmuls run here (else both functions use the torch reference)."""
    return _kernels() is not None


def _check(blocks: torch.Tensor, qtype: str, in_features: int) -> None:
    if qtype not in _QTYPE_CODES:
        raise ValueError(f"GGUF qtype {qtype!r} is not supported by the CPU kernels; "
                         f"supported: {', '.join(QTYPES)}")
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise TypeError("blocks must be a uint8 tensor [out_features, bytes_per_row] of GGUF "
                        f"blocks, got {getattr(blocks, 'dtype', type(blocks).__name__)} "
                        f"{tuple(getattr(blocks, 'shape', ()))}")
    expected = row_bytes(qtype, in_features)  # ValueError when not whole blocks
    if blocks.shape[1] != expected:
        raise ValueError(f"a {qtype} row of {in_features} values takes {expected} bytes, but "
                         f"blocks has {blocks.shape[1]} bytes per row")


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str,
                in_features: int, *, isa: str = "") -> torch.Tensor:
    """``x @ W.T`` with ``W`` in GGUF blocks: ``[tokens, in_features]`` float32 or bfloat16
    -> ``[tokens, out_features]`` in ``x``'s dtype.

    :param blocks: uint8 ``[out_features, bytes_per_row]``, each row that feature's blocks.
    :param qtype: "Q4_0", "Q4_1", "Q8_0", "Q4_K" or "Q6_K".
    :param in_features: values per weight row (a multiple of 32, or of 256 for K-quants).
    :param isa: force an instruction set of ``load_kernels().quant_isas`` ("" = the best).

    ``ValueError``/``TypeError`` for a bad qtype, shape or dtype (the message says which).
    """
    _check(blocks, qtype, in_features)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        raise TypeError(f"x must be a float32 or bfloat16 tensor [tokens, in_features], got "
                        f"{x.dtype} {tuple(x.shape)}")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight rows {in_features}")
    kernels = _kernels()
    if kernels is None or x.device.type != "cpu" or blocks.device.type != "cpu":
        weight = quant_reference.dequantize(blocks, qtype, in_features)
        return torch.nn.functional.linear(x.float(), weight.to(x.device)).to(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return kernels.gguf_matmul_op(x, blocks, _QTYPE_CODES[qtype], in_features, isa)


def dequantize(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The float32 weight ``[out_features, in_features]`` of GGUF ``blocks`` (rows of blocks)."""
    _check(blocks, qtype, in_features)
    kernels = _kernels()
    if kernels is None or blocks.device.type != "cpu":
        return quant_reference.dequantize(blocks, qtype, in_features)
    return kernels.gguf_dequantize_op(blocks, _QTYPE_CODES[qtype], in_features)


class GGUFQuantKernels:
    """The C++ GGUF kernels as the ``gguf`` quantization method calls them
    (``QuantizationConfig.kernels``). Inputs the C++ ops do not take (float16 activations, a
    tensor off the CPU) go to the core's torch reference, so every call is answered."""

    def gguf_matmul(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str,
                    in_features: int) -> torch.Tensor:
        """``x [..., in_features] @ W^T`` in ``x``'s dtype, ``W`` in ``qtype`` blocks."""
        if (x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu"
                or blocks.device.type != "cpu" or qtype not in _QTYPE_CODES):
            return gguf_matmul_reference(x, blocks, qtype, in_features)
        rows = x.reshape(-1, in_features)
        out = gguf_matmul(rows, blocks, qtype, in_features)
        return out.reshape(*x.shape[:-1], blocks.shape[0])

    def gguf_matmul_bound(self, blocks: torch.Tensor, qtype: str,
                          in_features: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> gguf_matmul(x, blocks, qtype, in_features)`` with the weight checked once
        here rather than at every call: a layer's matmul at batch 1 takes tens of
        microseconds, the Python checks of each call several. ``blocks`` must stay as it is."""
        if (blocks.device.type != "cpu" or qtype not in _QTYPE_CODES
                or _kernels() is None):
            return functools.partial(self.gguf_matmul, blocks=blocks, qtype=qtype,
                                     in_features=in_features)
        _check(blocks, qtype, in_features)
        op = _kernels().gguf_matmul_op
        code = _QTYPE_CODES[qtype]

        def matmul(x: torch.Tensor) -> torch.Tensor:
            if (x.dim() == 2 and x.dtype in _OP_DTYPES and x.device.type == "cpu"
                    and x.stride(1) == 1):
                return op(x, blocks, code, in_features, "")  # the op checks x's shape
            return self.gguf_matmul(x, blocks, qtype, in_features)

        return matmul

    def gguf_dequantize(self, blocks: torch.Tensor, qtype: str,
                        in_features: int) -> torch.Tensor:
        """float32 ``[rows, in_features]`` of ``qtype`` blocks ``[rows, bytes_per_row]``."""
        if blocks.device.type != "cpu" or qtype not in _QTYPE_CODES:
            return dequantize_rows(blocks, qtype, in_features)
        return dequantize(blocks, qtype, in_features)


def quant_kernels(method: str) -> GGUFQuantKernels | None:
    """The CPU backend's kernels for quantization ``method`` (``octavo_quant_kernels``): the C++
    GGUF ops for ``gguf``; ``None`` for other methods, where the C++ kernels cannot be had, or
    with ``OCTAVO_CPU_GGUF_KERNELS=0`` (the method's torch code then runs)."""
    if method != "gguf":
        return None
    if not envs.cpu_gguf_kernels():
        logger.info("GGUF weights: the CPU backend's C++ kernels are off "
                    "(OCTAVO_CPU_GGUF_KERNELS=0); the gguf method's torch path runs")
        return None
    if not kernels_available():
        return None  # the kernel loader has warned once, naming the fix
    return GGUFQuantKernels()
