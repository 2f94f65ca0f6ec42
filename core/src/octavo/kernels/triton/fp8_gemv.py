"""fp8 weight-only ("w8a16") skinny GEMM: ``x @ (W_fp8 * scale)^T`` for a few rows of ``x``.

``x [M, K]`` stays in its dtype (bfloat16 / float16 / float32: no activation quantization);
``W [N, K]`` is e4m3 with a float32 scale per output channel ``[N]`` (a per-tensor scale is
spread over the channels at load: ``octavo.model_executor.layers.quantization.fp8``). For
``M <= SMALL_M_MAX`` (``octavo.kernels.skinny``) the time is the read of ``W``, one byte per
weight: each program takes ``block_n`` weight rows and loops over its K range with
``[block_n, block_k]`` loads along the rows (K is contiguous: wide vector loads), upcasts the
e4m3 tile (exact in bf16/fp16/fp32) and accumulates in float32:

- one row (``M == 1``): ``acc[n] += sum_k W[n, k] * x[k]`` elementwise, no tensor cores;
- 2 to 16 rows: ``tl.dot`` of the rows (padded to a 16-row block) with the upcast tile.

The per-channel scale multiplies the sums once at the end. At one row on GPUs with PDL the
first step's weights are loaded before the kernel waits for the one before it
(``octavo.kernels.triton.pdl.skinny_pdl_launch``). Split-K programs add partial sums
with float32 atomics, summed in the kernel (``octavo.kernels.triton.skinny_gemm``).

Reference: ``octavo.kernels.fp8.fp8_linear_reference`` (dequantize, then matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.skinny import m_bucket
from octavo.kernels.triton.cache_write import dot_fp32, store_skinny_output, upcast_dot
from octavo.kernels.triton.dense_gemv import one_row_sums, sum_run
from octavo.kernels.triton.pdl import skinny_pdl_launch
from octavo.kernels.triton.skinny_gemm import (
    SkinnyConfig,
    SkinnyOutput,
    SkinnyTuner,
    choose_split_k,
    k_per_split,
    tune_key,
)

FP8_DTYPE = torch.float8_e4m3fn
TUNER = SkinnyTuner("fp8_gemv")


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # e4m3 [N, K]
    scale_ptr,  # float32 [N]
    out_ptr,  # [M, N] in x's dtype (float32 zeros: a split without a workspace)
    sums_ptr,  # float32 split-K workspace (store_skinny_output)
    arrivals_ptr,  # int32 arrival counts per block of outputs
    M,
    N,
    K,
    k_split,  # inputs per split, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,  # 1, or 16 for the tl.dot path
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IN_KERNEL_SUM: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr,  # one row under PDL: the next kernel may launch at the wait
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: the one-row loop without masks along K
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks along N
    SUM_RUN: tl.constexpr,  # one row: a step's products summed over runs (one_row_sums)
    LOAD_STAGES: tl.constexpr,  # one row: steps whose loads are in flight (one_row_sums)
    USE_PDL: tl.constexpr,  # one row: launched with PDL (octavo.kernels.triton.pdl)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N) | EVEN_N  # all true (no masks) when N % BLOCK_N == 0
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    scale_ptrs = scale_ptr + offs_n  # [BLOCK_N]
    if BLOCK_M == 1:
        # The scales with the first step's weights, before the PDL wait (dense_gemv.
        # one_row_sums): loaded after the K loop, they cost each program a memory round trip
        # at its end, exposed in a kernel whose programs all run in one wave.
        scale = tl.load(scale_ptrs, mask=n_mask, other=0.0)
        acc = one_row_sums(x_ptr, w_rows, offs_n, n_mask, k_start, k_end, BLOCK_K,
                           EARLY_TRIGGER, USE_PDL, EVEN_K, SUM_RUN, LOAD_STAGES)
        acc = acc * scale
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            acc += dot_fp32(x, tl.trans(w.to(x.dtype)), UPCAST_DOT, "ieee")
        acc = acc * tl.load(scale_ptrs, mask=n_mask, other=0.0)[None, :]
    store_skinny_output(out_ptr, acc, offs_m, m_mask, offs_n, n_mask, N, BLOCK_M, SPLIT_K,
                        sums_ptr, arrivals_ptr, IN_KERNEL_SUM)


def default_config(n: int, k: int, m: int) -> SkinnyConfig:
    """The untuned launch: 16 rows x 512 inputs of e4m3 (8 KiB) per step for one row,
    32 x 256 tiles for the ``tl.dot`` path."""
    if m == 1:
        return SkinnyConfig(block_n=16, block_k=512)
    return SkinnyConfig(block_n=32, block_k=256)


# One-row configs with software-pipelined K loops (``SkinnyConfig.load_stages``; on the H100
# they won at every shape but gate_up: docs/benchmarks.md, "Pipelined one-row loops").
PIPELINED_CONFIGS = [SkinnyConfig(16, 512, load_stages=3), SkinnyConfig(16, 512, load_stages=4),
                     SkinnyConfig(8, 1024, load_stages=4), SkinnyConfig(32, 256, load_stages=4),
                     SkinnyConfig(16, 1024, sum_runs=True, load_stages=3),
                     SkinnyConfig(32, 512, num_warps=8, sum_runs=True, load_stages=4),
                     SkinnyConfig(16, 512, split_k=1, load_stages=4)]


def candidate_configs(m: int) -> list[SkinnyConfig]:
    """What the tuner times for rows bucket ``m``."""
    if m == 1:
        return [SkinnyConfig(8, 512), SkinnyConfig(16, 256), SkinnyConfig(16, 1024, num_warps=8),
                SkinnyConfig(32, 256), SkinnyConfig(32, 512, num_warps=8),
                SkinnyConfig(64, 256, num_warps=8),
                # 16-input runs summed first: 16-32 KiB tiles in ~70-130 registers
                SkinnyConfig(16, 1024, sum_runs=True), SkinnyConfig(8, 2048, sum_runs=True),
                SkinnyConfig(32, 1024, num_warps=8, sum_runs=True),
                SkinnyConfig(16, 2048, num_warps=8, sum_runs=True),
                SkinnyConfig(64, 512, num_warps=8, sum_runs=True),
                SkinnyConfig(16, 1024, num_warps=8, early_trigger=False),
                SkinnyConfig(32, 512, num_warps=8, early_trigger=False),
                *PIPELINED_CONFIGS]
    return [SkinnyConfig(16, 256), SkinnyConfig(64, 128), SkinnyConfig(32, 512, num_warps=8),
            SkinnyConfig(64, 256, num_warps=8), SkinnyConfig(32, 128)]


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            config: SkinnyConfig) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    split = choose_split_k(n, k, config, x.device)
    out = SkinnyOutput.make(m, n, config.block_n, split, x.dtype, x.device)
    grid = (triton.cdiv(n, config.block_n), split)
    _fp8_gemv_kernel[grid](
        x, weight, scale, out.out, out.sums, out.arrivals, m, n, k,
        k_per_split(k, split, config.block_k), x.stride(0), weight.stride(0),
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, IN_KERNEL_SUM=out.in_kernel_sum, UPCAST_DOT=upcast_dot(x.dtype),
        EARLY_TRIGGER=config.early_trigger, EVEN_K=k % config.block_k == 0,
        EVEN_N=n % config.block_n == 0, SUM_RUN=sum_run(config, weight),
        LOAD_STAGES=config.load_stages,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **skinny_pdl_launch(x.device, m),
    )
    return out.result()


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bfloat16 / float16 / float32, M <= SMALL_M_MAX
    weight: torch.Tensor,  # e4m3 [N, K]
    weight_scale: torch.Tensor,  # float32 [N] (or a scalar: one for every channel)
    config: SkinnyConfig | None = None,  # None: tuned (GPU) or default_config
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ (weight * weight_scale[:, None])^T`` without quantizing ``x`` (module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != FP8_DTYPE or weight.shape[1] != k:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} are not [M, K] activations and an e4m3 [N, K] weight")
    scale = weight_scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n).contiguous()
    if scale.numel() != n:
        raise ValueError(f"fp8_gemv: {scale.numel()} weight scales for {n} output channels "
                         "(per-channel or per-tensor scales only)")
    x = x.contiguous()
    weight = weight.contiguous()
    if config is None:
        bucket = m_bucket(m)
        config = TUNER.choose(
            tune_key(n=n, k=k, m=bucket, dtype=x.dtype), x.device,
            default_config(n, k, bucket),
            candidate_configs(bucket), lambda c: _launch(x, weight, scale, c))
    return _launch(x, weight, scale, config)
