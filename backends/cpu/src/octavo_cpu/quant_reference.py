"""Plain-torch reference of the GGUF matmul kernels: dequantizers written from the block
layouts, the int8 quantization of the activations, and the matmul they make together.

Block layouts (little-endian; ``f16`` = IEEE half; a row of ``in_features`` values is
``in_features / block_elems`` consecutive blocks):

========  ==========  =======================================================================
qtype     block       bytes, and the value of element ``i``
========  ==========  =======================================================================
Q4_0      32 / 18 B   f16 d, 16 B nibbles; low nibble of byte i = element i, high = i + 16;
                      ``d * (q - 8)``
Q4_1      32 / 20 B   f16 d, f16 m, 16 B nibbles as Q4_0; ``d * q + m``
Q8_0      32 / 34 B   f16 d, 32 int8 q; ``d * q``
Q4_K      256 / 144 B f16 d, f16 dmin, 12 B scales, 128 B nibbles. Sub-block j (32 values) has
                      a 6-bit scale sc_j and min mn_j: for j < 4, sc = s[j] & 63, mn = s[j+4] &
                      63; else sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, mn = (s[j+4] >> 4) |
                      (s[j] >> 6) << 4. Bytes 32i..32i+31 of the nibbles: low = sub-block 2i,
                      high = 2i + 1. ``d * sc_j * q - dmin * mn_j``
Q6_K      256 / 210 B 128 B ql, 64 B qh, 16 int8 scales (one per 16 values), f16 d. In each half
                      h (128 values) element 32k + l (k < 4, l < 32) has low 4 bits from ql[64h
                      + l] (k = 0), ql[64h + 32 + l] (k = 1), their high nibbles (k = 2, 3), and
                      high 2 bits (qh[32h + l] >> 2k) & 3; ``d * scale[e / 16] * (q - 32)``
========  ==========  =======================================================================

The kernels' arithmetic, exactly: each activation row is cut into chunks of 32 values, each
quantized as ``q8 = round_half_even(x * (1 / dx))`` with ``dx = max|x| / 127`` (float32), and
``y = sum over chunks of dot(W_chunk, q8 * dx)``. So ``gguf_matmul_reference`` (float64 sums)
matches the kernels up to their float32 summation order.
"""

from __future__ import annotations

import torch

QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
# qtype -> (values per block, bytes per block)
BLOCK_LAYOUTS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
                 "Q6_K": (256, 210)}
# Activations are quantized in chunks of this many values.
CHUNK = 32


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values in ``qtype`` (``ValueError`` if not whole
    blocks or an unknown qtype)."""
    if qtype not in BLOCK_LAYOUTS:
        raise ValueError(f"GGUF qtype {qtype!r} is not supported; supported: {', '.join(QTYPES)}")
    elems, nbytes = BLOCK_LAYOUTS[qtype]
    if in_features <= 0 or in_features % elems:
        raise ValueError(f"in_features {in_features} is not a positive multiple of {qtype}'s "
                         f"block of {elems} values")
    return in_features // elems * nbytes


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at bytes ``start:start+2`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, b]`` bytes -> ``[n, 2b]`` values: all low nibbles, then all high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes per block -> (scales, mins), each ``[n, 8]`` int."""
    s = s.long()
    low_sc, low_mn, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([low_sc & 63, (packed & 15) | ((low_sc >> 6) << 4)], dim=1)
    mins = torch.cat([low_mn & 63, (packed >> 4) | ((low_mn >> 6) << 4)], dim=1)
    return scales, mins


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _q4_k_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()  # sub-blocks in order
    scale = (d * scales.float()).unsqueeze(-1)  # [n, 8, 1]
    offset = (dmin * mins.float()).unsqueeze(-1)
    return (scale * q - offset).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, which 32 bytes, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32).long()  # [half, 1, l]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(b, 208)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).long()  # [n, half, k, l], k = 0..3
    high = (qh >> (2 * torch.arange(4).view(1, 1, 4, 1))) & 3  # [n, half, k, l]
    q = (low | (high << 4)).float() - 32.0  # [n, 2, 4, 32] = element order
    scale = (d * scales).reshape(n, 16, 1)  # one per 16 values
    return (scale * q.reshape(n, 16, 16)).reshape(n, 256)


_DEQUANTIZERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def dequantize(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of ``blocks`` (uint8 ``[rows, bytes_per_row]``)."""
    nbytes = row_bytes(qtype, in_features)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nbytes:
        raise ValueError(f"expected uint8 blocks [rows, {nbytes}] for {qtype} rows of "
                         f"{in_features} values, got {blocks.dtype} {tuple(blocks.shape)}")
    rows = blocks.shape[0]
    elems, block_bytes = BLOCK_LAYOUTS[qtype]
    flat = blocks.contiguous().reshape(-1, block_bytes)  # [rows * blocks_per_row, block_bytes]
    return _DEQUANTIZERS[qtype](flat).reshape(rows, in_features)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[tokens, in_features]`` as the kernels see it: int8 per chunk of 32 values
    times the chunk's scale, returned in float32 (``q8 * dx``)."""
    tokens, features = x.shape
    chunks = x.float().reshape(tokens, features // CHUNK, CHUNK)
    dx = chunks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    q8 = torch.round(chunks * inverse)  # half to even, like the kernels
    return (q8 * dx).reshape(tokens, features)


def gguf_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int,
                          *, quantize_x: bool = True) -> torch.Tensor:
    """``x @ dequantize(blocks).T`` in float64 (returned as float32), with ``x`` first
    quantized as the kernels do (``quantize_x=False``: the exact float product)."""
    weight = dequantize(blocks, qtype, in_features).double()
    xs = quantize_activations(x) if quantize_x else x.float()
    return (xs.double() @ weight.T).float()
