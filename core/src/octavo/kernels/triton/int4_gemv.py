"""Int4 weight-only (GPTQ/AWQ) skinny GEMM: ``x @ W^T`` for a few rows, reading each packed
int32 once.

Weights as ``int4_linear`` holds them (``octavo.kernels.int4``): ``qweight`` int32
``[K / 8, N]`` (eight consecutive inputs of one output per word; AWQ is repacked to it at
load), ``scales``/``zeros`` ``[G, N]``, and ``g_idx [K]`` for act-order checkpoints;
``W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``. The stored layout is read as is:
rows of words are contiguous along N, so a program's ``[block_k / 8, block_n]`` word tile is
coalesced and each word is loaded once (the tile GEMM ``int4_gemm`` loads it for each of its
eight inputs).

Each program takes ``block_n`` outputs and a range of K, ``block_k`` inputs per step with
``block_k`` dividing the group size, so a step lies inside one group ``g`` and the group's
scale and zero are applied once per output, after the sum:

    sum_k x[k] * W[n, k] = scales[g, n] * (sum_k x[k] * q[k, n] - zeros[g, n] * sum_k x[k])

- one row: the nibbles are shifted out of the words in registers (``[block_k / 8, 8,
  block_n]``) and summed against ``x`` elementwise;
- 2 to 16 rows: ``tl.dot`` of the rows (a 16-row block) with the nibbles as 16-bit values
  (exact: 0..15);
- act-order (``g_idx`` not the natural order): every input has its own group, so the tile is
  dequantized element by element (scales and zeros gathered per input) before the sum: correct
  but slower; such checkpoints could be permuted at load to contiguous groups (not done).

float32 accumulation; split-K programs add partial sums atomically
(``octavo.kernels.triton.skinny_gemm``).

Reference: ``octavo.kernels.int4.int4_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.skinny import m_bucket
from octavo.kernels.triton.cache_write import dot_fp32, store_skinny_output, upcast_dot
from octavo.kernels.triton.skinny_gemm import (
    SkinnyConfig,
    SkinnyTuner,
    choose_split_k,
    k_per_split,
    tune_key,
)

TUNER = SkinnyTuner("int4_gemv")


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [M, K] activations
    qweight_ptr,  # int32 [K / 8, N]
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # int32 [K] (read when HAS_G_IDX)
    out_ptr,  # [M, N]: float32 zeros when SPLIT_K > 1, else x's dtype
    M,
    N,
    K,
    group_size,  # a multiple of BLOCK_K unless HAS_G_IDX
    k_split,  # inputs per split, a multiple of BLOCK_K
    stride_xm,
    HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1, or 16 for the tl.dot path
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 8
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // 8)  # word rows of a step
    nibble = tl.arange(0, 8)
    shifts = nibble * 4
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if BLOCK_M == 1:
        # Per word row: sums over a word's eight inputs (in one thread) scaled by their group,
        # added across steps; reduced over the rows once at the end.
        acc_rows = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + offs_w  # [W] word rows
        row_mask = rows * 8 < k_end  # K and k_end are multiples of 8
        words = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=row_mask[:, None] & n_mask[None, :], other=0)  # [W, BLOCK_N]
        # [W, 8, BLOCK_N]: input 8w + j in nibble j (for the tl.dot paths; the one-row paths
        # shift nibble by nibble and leave it unused, so it is not computed there)
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        offs_k = k0 + offs_w[:, None] * 8 + nibble[None, :]  # [W, 8]
        k_mask = offs_k < k_end
        if HAS_G_IDX and BLOCK_M == 1:
            # Every input has its own group: gather its scale and zero per nibble, in the
            # words' [W, BLOCK_N] layout (as the natural-order path below).
            x_words = x_ptr + k0 + offs_w[:, None] * 8  # [W, 1]
            x_mask = row_mask[:, None]
            for j in tl.static_range(8):
                xj = tl.load(x_words + j, mask=x_mask, other=0.0).to(tl.float32)  # [W, 1]
                gj = tl.load(g_idx_ptr + k0 + offs_w[:, None] * 8 + j, mask=x_mask, other=0)
                sz = gj.to(tl.int64) * N + offs_n[None, :]  # [W, BLOCK_N]
                sz_mask = x_mask & n_mask[None, :]
                scale = tl.load(scales_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                qj = ((words >> (4 * j)) & 0xF).to(tl.float32)
                acc_rows += (qj - zero) * scale * xj
        elif HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)  # [W, 8]
            sz = groups[:, :, None].to(tl.int64) * N + offs_n[None, None, :]
            sz_mask = k_mask[:, :, None] & n_mask[None, None, :]
            scale = tl.load(scales_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - zero) * scale  # [W, 8, BLOCK_N]
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
                        + (k0 + tl.arange(0, BLOCK_K))[None, :],
                        mask=m_mask[:, None] & (k0 + tl.arange(0, BLOCK_K) < k_end)[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w2 = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x.dtype)
            acc += dot_fp32(x, w2, UPCAST_DOT, "ieee")
        else:
            g = k0 // group_size
            if BLOCK_M == 1:
                # Nibble by nibble in the words' [W, BLOCK_N] layout, x as [W, 1] columns:
                # no register shuffles through shared memory inside the loop.
                x_words = x_ptr + k0 + offs_w[:, None] * 8  # [W, 1]: inputs 8w .. 8w + 7
                x_mask = row_mask[:, None]
                qx = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
                xs = tl.zeros((BLOCK_K // 8, 1), dtype=tl.float32)
                for j in tl.static_range(8):
                    xj = tl.load(x_words + j, mask=x_mask, other=0.0).to(tl.float32)
                    qx += ((words >> (4 * j)) & 0xF).to(tl.float32) * xj
                    xs += xj
                # The group's scales and zeros broadcast over the word rows in the load itself
                # (repeats hit L1), again to stay in the words' layout.
                sz = g * N + offs_n[None, :] + offs_w[:, None] * 0  # [W, BLOCK_N]
                sz_mask = n_mask[None, :] & x_mask
                scale = tl.load(scales_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                acc_rows += (qx - xs * zero) * scale
            else:
                scale = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                offs_kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_kk[None, :],
                            mask=m_mask[:, None] & (offs_kk < k_end)[None, :],
                            other=0.0)  # [BLOCK_M, BLOCK_K]
                if UPCAST_DOT:  # the interpreter casts int32 -> bfloat16 wrongly
                    q2 = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
                else:
                    q2 = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(x.dtype)
                qx = dot_fp32(x, q2, UPCAST_DOT, "ieee")  # [BLOCK_M, BLOCK_N]
                xs = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                acc += (qx - xs[:, None] * zero[None, :]) * scale[None, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc_rows, axis=0)
    store_skinny_output(out_ptr, acc, offs_m, m_mask, offs_n, n_mask, N, BLOCK_M, SPLIT_K)


def default_config(n: int, k: int, m: int) -> SkinnyConfig:
    """The untuned launch: 128 outputs x 128 inputs (one group of 128: 8 KiB of words) per
    step for one row; 64 x 128 for the ``tl.dot`` path."""
    return SkinnyConfig(block_n=128 if m == 1 else 64, block_k=128)


def candidate_configs(m: int) -> list[SkinnyConfig]:
    """What the tuner times for rows bucket ``m`` (``block_k`` is cut to the group size)."""
    if m == 1:
        return [SkinnyConfig(64, 128), SkinnyConfig(128, 128, num_warps=8),
                SkinnyConfig(256, 64, num_warps=8), SkinnyConfig(256, 32),
                SkinnyConfig(512, 32, num_warps=8), SkinnyConfig(32, 128),
                SkinnyConfig(128, 64, num_stages=3)]
    return [SkinnyConfig(32, 128), SkinnyConfig(128, 128, num_warps=8),
            SkinnyConfig(64, 64), SkinnyConfig(128, 64)]


def fit_block_k(block_k: int, group_size: int, has_g_idx: bool) -> int:
    """``block_k`` cut so that a step stays inside one group: the largest power of two at most
    ``block_k`` dividing ``group_size`` (at least 8: groups are multiples of 8)."""
    if has_g_idx:
        return block_k
    fitted = block_k
    while fitted > 8 and group_size % fitted:
        fitted //= 2
    return fitted


def _launch(x, qweight, scales, zeros, group_size, g_idx, config: SkinnyConfig) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[1]
    block_k = fit_block_k(config.block_k, group_size, g_idx is not None)
    split = choose_split_k(n, k, SkinnyConfig(config.block_n, block_k, config.split_k), x.device)
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), split)
    _int4_gemv_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        m, n, k, group_size, k_per_split(k, split, block_k), x.stride(0),
        HAS_G_IDX=g_idx is not None,
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=config.block_n, BLOCK_K=block_k,
        SPLIT_K=split, UPCAST_DOT=upcast_dot(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out if split == 1 else out.to(x.dtype)


def int4_gemv(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, M <= SMALL_M_MAX
    qweight: torch.Tensor,  # int32 [K / 8, N]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
    g_idx: torch.Tensor | None = None,  # int32 [K] (act-order), or None
    config: SkinnyConfig | None = None,  # None: tuned (GPU) or default_config
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T`` for 4-bit ``W`` (see the module docstring)."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(
            f"int4_gemv: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
            f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not describe one [K={k}] x "
            f"[N={n}] weight")
    if g_idx is None and group_size % 8:
        raise ValueError(f"int4_gemv: group_size {group_size} is not a multiple of 8")
    x = x.contiguous()
    if config is None:
        bucket = m_bucket(m)
        config = TUNER.choose(
            tune_key(n=n, k=k, m=bucket, dtype=x.dtype, group=group_size,
                     act_order=g_idx is not None), x.device,
            default_config(n, k, bucket), candidate_configs(bucket),
            lambda c: _launch(x, qweight, scales, zeros, group_size, g_idx, c))
    return _launch(x, qweight, scales, zeros, group_size, g_idx, config)
