"""GGUF (llama.cpp) quantized blocks: dequantizing them, and the matmul that keeps them.

A quantized GGUF weight of ``N`` rows (outputs) and ``K`` columns (inputs) is stored row by
row, each row a sequence of blocks of ``block_size`` values in ``type_size`` bytes
(``GGUF_BLOCKS``); Octavo keeps it as a uint8 tensor ``[N, K / block_size * type_size]``.
Blocks (little-endian; ``d``/``dmin`` are float16):

- ``Q8_0`` (32 values, 34 bytes): ``d``, 32 int8 ``q``; ``x = d * q``.
- ``Q4_0`` (32, 18): ``d``, 16 bytes of nibbles (value ``j < 16`` in the low nibble of byte
  ``j``, value ``j + 16`` in its high nibble); ``x = d * (q - 8)``.
- ``Q4_1`` (32, 20): ``d``, ``m``, 16 bytes of nibbles as Q4_0; ``x = d * q + m``.
- ``Q4_K`` (256, 144): ``d``, ``dmin``, 12 bytes of 6-bit scales and mins for eight
  sub-blocks of 32, 128 bytes of nibbles (64 values per 32 bytes: low nibbles, then high);
  ``x = d * scale[s] * q - dmin * min[s]``.
- ``Q6_K`` (256, 210): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
  scales (one per 16 values), ``d`` last; ``x = d * scale * (q - 32)``.

``dequantize_blocks`` is the vectorized torch reference (checked against ``gguf``'s numpy
``gguf.quants.dequantize``); ``gguf_linear`` multiplies without keeping a dense weight: through
a backend's kernel when given one (``octavo_quant_kernels``: ``gguf_matmul``), on GPUs the
Triton skinny kernel for at most ``SMALL_M_MAX`` rows (``octavo.kernels.triton.gguf_gemv``) and
the dequantize-in-GEMM tile kernel for more (``octavo.kernels.triton.gguf_gemm``), else by
dequantizing the weight just for the matmul (``gguf_matmul_reference``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from octavo.kernels.skinny import use_small_m_kernel
from octavo.kernels.triton_support import optional_triton_kernels

#: qtype name -> (values per block, bytes per block).
GGUF_BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}


def bytes_per_row(qtype: str, in_features: int) -> int:
    """Bytes one row of ``in_features`` values takes in ``qtype``."""
    block_size, type_size = GGUF_BLOCKS[qtype]
    if in_features % block_size:
        raise ValueError(f"{in_features} values do not fill whole {qtype} blocks of "
                         f"{block_size}")
    return in_features // block_size * type_size


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes ``start:start + 2`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]`` values: low nibbles first, then high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _fp16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _fp16(blocks, 2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)  # [n, 1]
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, mid, high = packed[:, 0], packed[:, 1], packed[:, 2]  # [n, 4] each
    scale = torch.cat([low & 63, (high & 0x0F) | ((low >> 6) << 4)], dim=1).float()  # [n, 8]
    minimum = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=1).float()
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (d[:, :, None] * scale[:, :, None] * q - dmin[:, :, None] * minimum[:, :, None]
            ).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int16) - 32  # [n, 8, 32]
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _fp16(blocks, 208)  # [n, 1]
    return ((d * scale)[:, :, None] * q.reshape(n, 16, 16).float()).reshape(n, 256)


_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k,
}


def dequantize_blocks(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 ``[num_blocks, type_size]`` -> float32 ``[num_blocks, block_size]``."""
    if qtype not in _DEQUANTIZERS:
        raise ValueError(f"no torch dequantizer for GGUF type {qtype}; supported: "
                         f"{', '.join(_DEQUANTIZERS)}")
    return _DEQUANTIZERS[qtype](blocks)


def dequantize_rows(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """uint8 ``[N, bytes_per_row]`` -> float32 ``[N, in_features]``."""
    _, type_size = GGUF_BLOCKS[qtype]
    if blocks.shape[1] != bytes_per_row(qtype, in_features):
        raise ValueError(f"{qtype} rows of {in_features} values take "
                         f"{bytes_per_row(qtype, in_features)} bytes, got {blocks.shape[1]}")
    flat = dequantize_blocks(blocks.reshape(-1, type_size), qtype)
    return flat.reshape(blocks.shape[0], in_features)


def gguf_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str,
                          in_features: int) -> torch.Tensor:
    """``x @ W^T`` with ``W`` dequantized to ``x``'s dtype for this product only."""
    return F.linear(x, dequantize_rows(blocks, qtype, in_features).to(x.dtype))


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int,
                kernels: Any = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in ``x``'s dtype, ``W`` kept in its blocks (see the module
    docstring for which kernel runs)."""
    backend_kernel = getattr(kernels, "gguf_matmul", None)
    if backend_kernel is not None:
        return backend_kernel(x, blocks, qtype, in_features)
    if x.device.type == "cuda":
        if use_small_m_kernel(x.shape[0]):
            triton_kernels = optional_triton_kernels("gguf_gemv")
            if triton_kernels is not None:
                return triton_kernels.gguf_gemv(x, blocks, qtype, in_features)
        triton_kernels = optional_triton_kernels("gguf_gemm")
        if triton_kernels is not None:
            return triton_kernels.gguf_gemm(x, blocks, qtype, in_features)
    return gguf_matmul_reference(x, blocks, qtype, in_features)
