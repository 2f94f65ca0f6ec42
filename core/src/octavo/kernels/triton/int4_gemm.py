"""Int4 weight-only GEMM (GPTQ/AWQ weights): 4-bit tiles dequantized inside the matmul.

``out[M, N] = x[M, K] @ W^T`` with ``W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``,
``q`` packed eight inputs per int32 (``qweight [K / 8, N]``, GPTQ's layout, or the same words
in 32-output panels ``[N / 32, K / 8, 32]``; see ``octavo.kernels.int4``), ``g(k) = g_idx[k]``
for act-order weights, else ``k // group_size``.

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile over a range of K: it loads the int32 words
of its ``[BLOCK_K, BLOCK_N]`` weight tile (each word read for eight rows, from cache), shifts
out the nibbles, subtracts the zero points and multiplies by the scales of each row's group,
then ``tl.dot``s the activations with the dequantized tile, accumulating in float32. Decode
steps (few rows) split K over ``split_k`` programs so enough of them stream the weights, and
the partial tiles are summed after.

Reference: ``octavo.kernels.int4.int4_linear_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from octavo.kernels.int4 import is_panels, word_shape
from octavo.kernels.triton.cache_write import dot_fp32, upcast_dot


@dataclass(frozen=True, slots=True)
class Int4GemmConfig:
    """Tile sizes (defaults meant for NVIDIA H100; the CPU interpreter takes small ones)."""

    # Activation rows per tile (tl.dot needs at least 16).
    block_m: int = 16
    # Output features per tile.
    block_n: int = 64
    # Input features per loop step (a multiple of 8: whole int32 words).
    block_k: int = 128
    # Programs a K range is split over when few tiles cover M x N (0: choose from the shape).
    split_k: int = 0
    # Programs wanted in flight before splitting K stops paying (about 2 per SM on an H100).
    target_programs: int = 264


DEFAULT_CONFIG = Int4GemmConfig()


@triton.jit
def word_offsets(offs_n, N, K, PANELS: tl.constexpr):
    """``(row_words, word_cols)``: word ``(r, n)`` of ``qweight`` is at ``r * row_words +
    word_cols[n]``, in GPTQ's layout (``N``, ``offs_n``) or in 32-output panels (``32``, each
    output's panel start ``(n // 32) * (K / 8) * 32`` plus ``n % 32``). int32 columns: panels
    are only made of weights of fewer than 2^31 words (``to_panels``)."""
    if PANELS:
        return 32, (offs_n // 32) * (K // 8 * 32) + offs_n % 32
    return N, offs_n


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K] activations
    qweight_ptr,  # int32 [K / 8, N], or [N / 32, K / 8, 32] (PANELS)
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # int32 [K] (read when HAS_G_IDX)
    out_ptr,  # [SPLIT_K, M, N] float32 partial sums, or [M, N] in x's dtype when SPLIT_K == 1
    M,
    N,
    K,
    group_size,
    k_per_split,  # multiple of BLOCK_K
    stride_xm,
    HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PANELS: tl.constexpr = False,  # qweight in 32-output panels
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # word (r, n) at r * row_words + word_cols[n]
    row_words, word_cols = word_offsets(offs_n, N, K, PANELS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + (offs_k // 8)[:, None].to(tl.int64) * row_words
                        + word_cols[None, :],
                        mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N] int32, 8 rows per word
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
        else:
            groups = offs_k // group_size
        sz_offsets = groups[:, None].to(tl.int64) * N + offs_n[None, :]
        scale = tl.load(scales_ptr + sz_offsets, mask=w_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + sz_offsets, mask=w_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - zero) * scale).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += dot_fp32(x, w, UPCAST_DOT, DOT_PRECISION)
    out_offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + out_offsets, acc, mask=out_mask)


def choose_split_k(m: int, n: int, k: int, config: Int4GemmConfig) -> int:
    """How many programs share each tile's K range: enough to reach ``target_programs``,
    keeping at least two K steps per program."""
    if config.split_k:
        return config.split_k
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    split = 1
    while tiles * split * 2 <= config.target_programs and steps // (split * 2) >= 2:
        split *= 2
    return split


def int4_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # int32 [K / 8, N], or panels [N / 32, K / 8, 32]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
    g_idx: torch.Tensor | None = None,  # int32 [K]
    config: Int4GemmConfig = DEFAULT_CONFIG,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T`` for 4-bit ``W`` (see the module docstring)."""
    m, k = x.shape
    rows, n = word_shape(qweight)
    if rows * 8 != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(
            f"int4_gemm: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
            f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not describe one [K={k}] x "
            f"[N={n}] weight")
    if config.block_k % 8:
        raise ValueError(f"block_k must be a multiple of 8, got {config.block_k}")
    x = x.contiguous()
    split_k = choose_split_k(m, n, k, config)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split_k)
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        m, n, k, group_size, k_per_split, x.stride(0),
        HAS_G_IDX=g_idx is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split_k, UPCAST_DOT=upcast_dot(x.dtype), DOT_PRECISION="ieee",
        PANELS=is_panels(qweight),
    )
    return out if split_k == 1 else out.sum(dim=0).to(x.dtype)
