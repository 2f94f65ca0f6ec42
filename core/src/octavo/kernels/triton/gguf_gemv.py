"""GGUF skinny GEMM: ``x @ W^T`` for a few rows with ``W`` in llama.cpp blocks.

The same block decoding as the tile kernel (``octavo.kernels.triton.gguf_gemm._dequant_tile``:
every value's bits, scale and minimum located by arithmetic on its input index), shaped for
decode like the fp8 and int4 skinny kernels: a program takes ``block_n`` rows of ``W`` and a
range of K; for one row of ``x`` it multiplies the decoded ``[block_k, block_n]`` tile by
``x`` elementwise and sums per lane across steps (one reduction over K at the end, no padded
``tl.dot``); for 2 to 16 rows it ``tl.dot``s a 16-row block. Split-K programs add float32
partial sums atomically, instead of the tile kernel's ``[split_k, M, N]`` partials and a
separate sum (``octavo.kernels.triton.skinny_gemm``). Every type of the tile kernel runs
(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K); scales are still read per value (from cache), so this is
less specialised than ``int4_gemv``.

Reference: ``octavo.kernels.gguf.gguf_matmul_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.gguf import GGUF_BLOCKS, bytes_per_row
from octavo.kernels.skinny import m_bucket
from octavo.kernels.triton.cache_write import dot_fp32, store_skinny_output, upcast_dot
from octavo.kernels.triton.gguf_gemm import _QTYPE_CODES, _dequant_tile
from octavo.kernels.triton.skinny_gemm import (
    SkinnyConfig,
    SkinnyOutput,
    SkinnyTuner,
    choose_split_k,
    k_per_split,
    tune_key,
)

TUNER = SkinnyTuner("gguf_gemv")


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # uint8 [N, row_bytes]
    out_ptr,  # [M, N] in x's dtype (float32 zeros: a split without a workspace)
    sums_ptr,  # float32 split-K workspace (store_skinny_output)
    arrivals_ptr,  # int32 arrival counts per block of outputs
    M,
    N,
    K,
    row_bytes,
    k_split,  # inputs per split, a multiple of BLOCK_K
    stride_xm,
    QTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,  # values per GGUF block
    TYPE_SIZE: tl.constexpr,  # bytes per GGUF block
    BLOCK_M: tl.constexpr,  # 1, or 16 for the tl.dot path
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IN_KERNEL_SUM: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n[None, :].to(tl.int64) * row_bytes  # [1, BLOCK_N]
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if BLOCK_M == 1:
        acc_lanes = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        mask = k_mask[:, None] & n_mask[None, :]
        w = _dequant_tile(rows, offs_k, mask, QTYPE, QBLOCK, TYPE_SIZE)
        w = tl.where(mask, w, 0.0)  # [BLOCK_K, BLOCK_N] float32
        if BLOCK_M == 1:
            # x as a [BLOCK_K, BLOCK_N] broadcast: the tile's register layout (see fp8_gemv)
            x = tl.load(x_ptr + offs_k[:, None] + offs_n[None, :] * 0, mask=k_mask[:, None],
                        other=0.0).to(tl.float32)
            acc_lanes += w * x
        else:
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            acc += dot_fp32(x, w.to(x.dtype), UPCAST_DOT, "ieee")
    if BLOCK_M == 1:
        acc = tl.sum(acc_lanes, axis=0)
    store_skinny_output(out_ptr, acc, offs_m, m_mask, offs_n, n_mask, N, BLOCK_M, SPLIT_K,
                        sums_ptr, arrivals_ptr, IN_KERNEL_SUM)


def default_config(n: int, k: int, m: int) -> SkinnyConfig:
    """The untuned launch: 64 rows x 64 inputs per step."""
    return SkinnyConfig(block_n=64, block_k=64)


def candidate_configs(m: int) -> list[SkinnyConfig]:
    """What the tuner times for rows bucket ``m``."""
    return [SkinnyConfig(32, 64), SkinnyConfig(32, 128), SkinnyConfig(64, 128, num_warps=8),
            SkinnyConfig(128, 32), SkinnyConfig(16, 256)]


def _launch(x, blocks, qtype, config: SkinnyConfig) -> torch.Tensor:
    m, k = x.shape
    n = blocks.shape[0]
    split = choose_split_k(n, k, config, x.device)
    out = SkinnyOutput.make(m, n, config.block_n, split, x.dtype, x.device)
    qblock, type_size = GGUF_BLOCKS[qtype]
    grid = (triton.cdiv(n, config.block_n), split)
    _gguf_gemv_kernel[grid](
        x, blocks, out.out, out.sums, out.arrivals, m, n, k, blocks.shape[1],
        k_per_split(k, split, config.block_k), x.stride(0),
        QTYPE=_QTYPE_CODES[qtype], QBLOCK=qblock, TYPE_SIZE=type_size,
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, IN_KERNEL_SUM=out.in_kernel_sum, UPCAST_DOT=upcast_dot(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.result()


def gguf_gemv(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, M <= SMALL_M_MAX
    blocks: torch.Tensor,  # uint8 [N, K / block_size * type_size]
    qtype: str,
    in_features: int,
    config: SkinnyConfig | None = None,  # None: tuned (GPU) or default_config
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T`` for ``W`` in GGUF ``qtype`` blocks (see the module docstring)."""
    if qtype not in _QTYPE_CODES:
        raise ValueError(f"gguf_gemv runs {', '.join(_QTYPE_CODES)}, not {qtype}")
    m, k = x.shape
    n = blocks.shape[0]
    row_bytes = bytes_per_row(qtype, in_features)
    if k != in_features or blocks.shape[1] != row_bytes or blocks.dtype != torch.uint8:
        raise ValueError(f"gguf_gemv: x {tuple(x.shape)} and {qtype} blocks "
                         f"{tuple(blocks.shape)} {blocks.dtype} do not describe a weight of "
                         f"{in_features} inputs ({row_bytes} uint8 per row)")
    x = x.contiguous()
    blocks = blocks.contiguous()
    if config is None:
        bucket = m_bucket(m)
        config = TUNER.choose(
            tune_key(n=n, k=k, m=bucket, dtype=x.dtype, qtype=qtype), x.device,
            default_config(n, k, bucket),
            candidate_configs(bucket), lambda c: _launch(x, blocks, qtype, c))
    return _launch(x, blocks, qtype, config)
