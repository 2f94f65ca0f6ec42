"""GGUF GEMM: ``x @ W^T`` with ``W`` kept in llama.cpp blocks, dequantized tile by tile.

``W`` is uint8 ``[N, K / block_size * type_size]`` (``octavo.kernels.gguf`` describes the
block formats). Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile over a range of K:
for every input ``k`` of a ``[BLOCK_K, BLOCK_N]`` tile of ``W^T`` it computes where in its row
the value's bits, scale and minimum lie (the same for every row, so vectors over ``k``), gathers
those bytes (each read for several values, from cache), rebuilds the values in float32, and
``tl.dot``s the activations with the tile. Decode steps split K over several programs like the
int4 kernel (``octavo.kernels.triton.int4_gemm``).

Reference: ``octavo.kernels.gguf.gguf_matmul_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.gguf import GGUF_BLOCKS, bytes_per_row
from octavo.kernels.triton.cache_write import dot_fp32, upcast_dot
from octavo.kernels.triton.int4_gemm import DEFAULT_CONFIG, Int4GemmConfig, choose_split_k

# Kernel-side type codes.
_QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4}


@triton.jit
def _fp16_at(ptrs, mask):
    """The little-endian float16 at byte pointers ``ptrs`` (and ``ptrs + 1``), as float32."""
    lo = tl.load(ptrs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(rows, offs_k, mask, QTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TYPE_SIZE: tl.constexpr):
    """Values ``W[n, k]`` for row pointers ``rows`` ``[1, BLOCK_N]`` and inputs ``offs_k``
    ``[BLOCK_K]``: float32 ``[BLOCK_K, BLOCK_N]``."""
    j = offs_k % BLOCK_SIZE  # position inside the block
    base = rows + ((offs_k // BLOCK_SIZE) * TYPE_SIZE)[:, None]  # [BLOCK_K, BLOCK_N] pointers
    if QTYPE == 2:  # Q8_0
        q = tl.load(base + 2 + j[:, None], mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _fp16_at(base, mask) * q.to(tl.float32)
    elif QTYPE == 0 or QTYPE == 1:  # Q4_0, Q4_1
        start = 2 if QTYPE == 0 else 4
        byte = tl.load(base + start + (j % 16)[:, None], mask=mask, other=0)
        q = ((byte >> (4 * (j // 16)).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
        if QTYPE == 0:
            w = _fp16_at(base, mask) * (q - 8.0)
        else:
            w = _fp16_at(base, mask) * q + _fp16_at(base + 2, mask)
    elif QTYPE == 3:  # Q4_K
        sub = j // 32
        within = j % 64
        byte = tl.load(base + 16 + ((j // 64) * 32 + within % 32)[:, None], mask=mask, other=0)
        q = ((byte >> (4 * (within // 32)).to(tl.uint8)[:, None]) & 0xF).to(tl.float32)
        s_low = tl.load(base + 4 + (sub % 4)[:, None], mask=mask, other=0)
        s_mid = tl.load(base + 8 + (sub % 4)[:, None], mask=mask, other=0)
        s_high = tl.load(base + 12 + (sub % 4)[:, None], mask=mask, other=0)
        first = (sub < 4)[:, None]
        scale = tl.where(first, s_low & 63, (s_high & 0xF) | ((s_low >> 6) << 4))
        minimum = tl.where(first, s_mid & 63, (s_high >> 4) | ((s_mid >> 6) << 4))
        w = (_fp16_at(base, mask) * scale.to(tl.float32) * q
             - _fp16_at(base + 2, mask) * minimum.to(tl.float32))
    else:  # Q6_K
        half = j // 128
        v = j % 128
        low = tl.load(base + (half * 64 + v % 64)[:, None], mask=mask, other=0)
        low = (low >> (4 * (v // 64)).to(tl.uint8)[:, None]) & 0xF
        high = tl.load(base + 128 + (half * 32 + v % 32)[:, None], mask=mask, other=0)
        high = (high >> (2 * (v // 32)).to(tl.uint8)[:, None]) & 3
        q = (low | (high << 4)).to(tl.float32) - 32.0
        scale = tl.load(base + 192 + (j // 16)[:, None], mask=mask, other=0).to(tl.int8,
                                                                                 bitcast=True)
        w = _fp16_at(base + 208, mask) * scale.to(tl.float32) * q
    return w


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # uint8 [N, row_bytes]
    out_ptr,  # [SPLIT_K, M, N] float32, or [M, N] in x's dtype when SPLIT_K == 1
    M,
    N,
    K,
    row_bytes,
    k_per_split,
    stride_xm,
    QTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = w_ptr + offs_n[None, :].to(tl.int64) * row_bytes  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        mask = k_mask[:, None] & n_mask[None, :]
        w = _dequant_tile(rows, offs_k, mask, QTYPE, BLOCK_SIZE, TYPE_SIZE)
        w = tl.where(mask, w, 0.0).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += dot_fp32(x, w, UPCAST_DOT, DOT_PRECISION)
    out_offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + out_offsets, acc, mask=out_mask)


def gguf_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    blocks: torch.Tensor,  # uint8 [N, K / block_size * type_size]
    qtype: str,
    in_features: int,
    config: Int4GemmConfig = DEFAULT_CONFIG,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T`` for ``W`` in GGUF ``qtype`` blocks (see the module docstring)."""
    if qtype not in _QTYPE_CODES:
        raise ValueError(f"gguf_gemm runs {', '.join(_QTYPE_CODES)}, not {qtype}")
    m, k = x.shape
    n = blocks.shape[0]
    row_bytes = bytes_per_row(qtype, in_features)
    if k != in_features or blocks.shape[1] != row_bytes or blocks.dtype != torch.uint8:
        raise ValueError(f"gguf_gemm: x {tuple(x.shape)} and {qtype} blocks "
                         f"{tuple(blocks.shape)} {blocks.dtype} do not describe a weight of "
                         f"{in_features} inputs ({row_bytes} uint8 per row)")
    block_size, type_size = GGUF_BLOCKS[qtype]
    x = x.contiguous()
    blocks = blocks.contiguous()
    split_k = choose_split_k(m, n, k, config)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split_k)
    _gguf_gemm_kernel[grid](
        x, blocks, out, m, n, k, row_bytes, k_per_split, x.stride(0),
        QTYPE=_QTYPE_CODES[qtype], BLOCK_SIZE=block_size, TYPE_SIZE=type_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split_k, UPCAST_DOT=upcast_dot(x.dtype), DOT_PRECISION="ieee",
    )
    return out if split_k == 1 else out.sum(dim=0).to(x.dtype)
