"""One-row GEMV for dense (bfloat16 / float16) weights that reads its weights while the kernel
before it still runs: ``x @ W^T (+ bias)`` for ``x`` ``[1, K]``.

At batch 1 a decode step is a chain of small kernels, and cuBLAS's GEMVs at a 0.5B model's
shapes take 4-7 µs each for weights that the memory reads in 0.4-4 µs
(docs/benchmarks.md): the launch, the first round trip to memory and the reduction are
exposed, one kernel after another. Nothing in a step writes the weights, so with
programmatic dependent launch (``octavo.kernels.triton.pdl``) this kernel loads its first
``[BLOCK_N, BLOCK_K]`` weight tile *before* it waits for the kernel before it (the RMS norm,
the attention, SiLU-and-mul that produce ``x``): the read overlaps that kernel, and what is
left after the wait is ``x``'s load (from L2), the products and the store. Programs whose
whole K range fits in one tile (every 0.5B shape but down) have all their weights in registers by
the time ``x`` is ready.

Each program takes ``BLOCK_N`` weight rows (K contiguous: wide loads along the rows) and a
range of K; products are summed per lane over the steps and reduced once at the end, in
float32; split-K programs add their partial sums in the kernel
(``octavo.kernels.triton.skinny_gemm``). The bias is added by the first split's programs.

``EARLY_TRIGGER`` chooses when the next kernel may launch: with the wait, once the first
tile's loads are issued, or after the K loop (its programs then take no SM slots while this
GEMV's later waves still need them). Neither wins at every shape (on an H200 early was as
fast or faster at 7 of 8 shapes in one run, 4 of 8 in another; on an H100 late won at the 8B
shape's gate_up and down by ~1 µs), so it is part of the launch config
(``SkinnyConfig.early_trigger``, default early) that the config tables record per shape.

Reference: ``torch.nn.functional.linear`` in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import store_skinny_output
from octavo.kernels.triton.pdl import pdl_launch
from octavo.kernels.triton.skinny_gemm import (
    SkinnyConfig,
    SkinnyOutput,
    SkinnyTuner,
    choose_split_k,
    k_per_split,
    tune_key,
)

TUNER = SkinnyTuner("dense_gemv")


@triton.jit
def _weights(w_rows, n_mask, k0, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile of the step at ``k0`` (zeros past ``k_end``;
    ``EVEN_K``: every step is whole, no mask along K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
    return tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < k_end)[None, :],
                   other=0.0)


@triton.jit
def _x_tile(x_ptr, offs_n, k0, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``x[k0 : k0 + BLOCK_K]`` as a ``[BLOCK_N, BLOCK_K]`` broadcast: the weight tile's
    register layout, no shuffle through shared memory. Unmasked (``EVEN_K``) the rows' loads
    are one load: a thread loads and converts its inputs once for all its rows (masked,
    the compiler keeps one load and conversion per row: ~1.5 more instructions per fp8
    weight)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_k[None, :] + offs_n[:, None] * 0
    if EVEN_K:
        return tl.load(x_ptrs)
    return tl.load(x_ptrs, mask=(offs_k < k_end)[None, :], other=0.0)


@triton.jit
def _x_row(x_ptr, k0, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``x[k0 : k0 + BLOCK_K]`` as ``[1, BLOCK_K]``: for the pipelined loop, whose loads go
    through shared memory anyway (a broadcast tile would be copied ``BLOCK_N`` times)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(x_ptr + offs_k)[None, :]
    return tl.load(x_ptr + offs_k, mask=offs_k < k_end, other=0.0)[None, :]


@triton.jit
def _step_products(w, x, SUM_RUN: tl.constexpr):
    """A step's products ``w * x`` in float32, ``[BLOCK_N, BLOCK_K]``, or with ``SUM_RUN``
    summed over runs of that many consecutive inputs (``[BLOCK_N, BLOCK_K / SUM_RUN]``)."""
    products = w.to(tl.float32) * x.to(tl.float32)
    if SUM_RUN > 0:
        products = tl.sum(tl.reshape(products, (w.shape[0], w.shape[1] // SUM_RUN, SUM_RUN)),
                          axis=2)
    return products


@triton.jit
def one_row_sums(x_ptr, w_rows, offs_n, n_mask, k_start, k_end, BLOCK_K: tl.constexpr,
                 EARLY_TRIGGER: tl.constexpr, USE_PDL: tl.constexpr, EVEN_K: tl.constexpr,
                 SUM_RUN: tl.constexpr, LOAD_STAGES: tl.constexpr):
    """``[BLOCK_N]`` float32 sums ``sum_k W[n, k] * x[k]`` over ``k_start .. k_end`` for the
    weight rows at ``w_rows`` (``[BLOCK_N, 1]`` pointers; 16-bit or e4m3 weights, upcast in
    registers), products summed per lane over the steps and reduced once at the end.

    The first step's weights are loaded before the PDL wait (no kernel of a step writes
    weights): their read overlaps the kernel before. ``EARLY_TRIGGER``: the next kernel may
    launch from the wait on; else after the K loop. ``EVEN_K``: the range is whole steps
    (``K % BLOCK_K == 0``; every program has at least one), loaded without masks along K.
    ``SUM_RUN`` (0, or the inputs one thread loads in a vector: 16 bytes' worth): each step's
    products are first summed over runs of that many inputs, inside each thread, so the
    per-lane sums take ``BLOCK_N * BLOCK_K / SUM_RUN`` registers instead of one per weight of
    the tile (~0.5 more instructions a weight; larger tiles fit, more bytes in flight per
    SM: ``SkinnyConfig.sum_runs``). ``LOAD_STAGES`` > 1 (``SkinnyConfig.load_stages``): the
    steps after the first run as a software-pipelined ``tl.range`` loop, later steps' weights
    copied into shared memory while the current one is summed, and ``x`` loaded as one row a
    step (a broadcast tile would be copied once per weight row). Also ``fp8_gemv``'s one-row
    loop."""
    w = _weights(w_rows, n_mask, k_start, k_end, BLOCK_K, EVEN_K)
    if USE_PDL:
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = _x_tile(x_ptr, offs_n, k_start, k_end, BLOCK_K, EVEN_K)
    acc_lanes = _step_products(w, x, SUM_RUN)
    # LOAD_STAGES > 1: later steps' loads copied ahead through shared memory (a pipelined
    # loop); else each step's loads are issued when it starts
    for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=max(LOAD_STAGES, 1)):
        w = _weights(w_rows, n_mask, k0, k_end, BLOCK_K, EVEN_K)
        if LOAD_STAGES > 1:
            acc_lanes += _step_products(w, _x_row(x_ptr, k0, k_end, BLOCK_K, EVEN_K), SUM_RUN)
        else:
            acc_lanes += _step_products(w, _x_tile(x_ptr, offs_n, k0, k_end, BLOCK_K, EVEN_K),
                                        SUM_RUN)
    if USE_PDL and not EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    return tl.sum(acc_lanes, axis=1)


def sum_run(config: SkinnyConfig, weight: torch.Tensor) -> int:
    """``one_row_sums``'s ``SUM_RUN`` for ``config`` and weights of ``weight``'s dtype: the
    inputs of one 16-byte load (8 bfloat16, 16 e4m3), when the config asks for
    ``sum_runs`` and a step holds whole runs."""
    run = 16 // weight.element_size()
    return run if config.sum_runs and config.block_k % run == 0 else 0


@triton.jit
def _dense_gemv_kernel(
    x_ptr,  # [1, K] activations
    w_ptr,  # [N, K] weights, rows contiguous
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [1, N] in x's dtype (float32 zeros: a split without a workspace)
    sums_ptr,  # float32 split-K workspace (store_skinny_output)
    arrivals_ptr,  # int32 arrival counts per block of outputs
    N,
    K,
    k_split,  # inputs per split, a multiple of BLOCK_K
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IN_KERNEL_SUM: tl.constexpr,
    EARLY_TRIGGER: tl.constexpr,  # let the next kernel launch before the K loop, not after
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks along N
    SUM_RUN: tl.constexpr,  # one_row_sums: a step's products summed over runs of inputs
    LOAD_STAGES: tl.constexpr,  # one_row_sums: steps whose loads are in flight (SkinnyConfig)
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N) | EVEN_N  # all true (no masks) when N % BLOCK_N == 0
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    acc = one_row_sums(x_ptr, w_rows, offs_n, n_mask, k_start, k_end, BLOCK_K, EARLY_TRIGGER,
                       USE_PDL, EVEN_K, SUM_RUN, LOAD_STAGES)  # [BLOCK_N]
    if HAS_BIAS:  # noqa: SIM102  (a compile-time branch around a run-time one)
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    store_skinny_output(out_ptr, acc, tl.arange(0, 1), tl.arange(0, 1) < 1, offs_n, n_mask, N,
                        1, SPLIT_K, sums_ptr, arrivals_ptr, IN_KERNEL_SUM)


def default_config(n: int, k: int) -> SkinnyConfig:
    """The untuned launch: 8 rows x 1024 inputs (16 KiB of bfloat16) per program and step."""
    return SkinnyConfig(block_n=8, block_k=1024)


# Configs with software-pipelined K loops (``SkinnyConfig.load_stages``; run against the
# reference on the H100, not yet swept there).
PIPELINED_CONFIGS = [SkinnyConfig(8, 512, load_stages=4), SkinnyConfig(8, 1024, load_stages=3),
                     SkinnyConfig(16, 512, load_stages=3), SkinnyConfig(4, 1024, load_stages=4),
                     SkinnyConfig(16, 1024, sum_runs=True, load_stages=3)]


def candidate_configs() -> list[SkinnyConfig]:
    """What the tuner times."""
    return [SkinnyConfig(8, 1024), SkinnyConfig(4, 1024), SkinnyConfig(16, 512),
            SkinnyConfig(8, 512), SkinnyConfig(16, 1024, num_warps=8),
            SkinnyConfig(32, 256), SkinnyConfig(4, 2048, num_warps=8),
            SkinnyConfig(8, 1024, split_k=1), SkinnyConfig(4, 1024, split_k=1),
            SkinnyConfig(8, 1024, split_k=4), SkinnyConfig(16, 512, split_k=8),
            # 8-input runs summed first: 32 KiB tiles in ~96 registers (not ~200)
            SkinnyConfig(16, 1024, sum_runs=True), SkinnyConfig(8, 2048, sum_runs=True),
            *PIPELINED_CONFIGS]


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           config: SkinnyConfig, early_trigger: bool | None = None,
           use_pdl: bool | None = None) -> torch.Tensor:
    """One launch with ``config`` (``early_trigger=None``: the config's; ``use_pdl=None``:
    as ``pdl_launch`` says for the device)."""
    n, k = weight.shape
    split = choose_split_k(n, k, config, x.device)
    out = SkinnyOutput.make(1, n, config.block_n, split, x.dtype, x.device)
    pdl = pdl_launch(x.device)
    if use_pdl is False:
        pdl = {"USE_PDL": False}
    grid = (triton.cdiv(n, config.block_n), split)
    _dense_gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, out.out, out.sums, out.arrivals, n, k,
        k_per_split(k, split, config.block_k), weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, IN_KERNEL_SUM=out.in_kernel_sum,
        EARLY_TRIGGER=config.early_trigger if early_trigger is None else early_trigger,
        EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        SUM_RUN=sum_run(config, weight), LOAD_STAGES=config.load_stages,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
    )
    return out.result()


def dense_gemv(
    x: torch.Tensor,  # [1, K] bfloat16 / float16
    weight: torch.Tensor,  # [N, K] in x's dtype, rows contiguous
    bias: torch.Tensor | None = None,  # [N] or None
    config: SkinnyConfig | None = None,  # None: table, tuned (GPU) or default_config
) -> torch.Tensor:  # [1, N] in x's dtype
    """``x @ weight^T + bias`` for one row (module docstring)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1] \
            or weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError(f"dense_gemv: x {tuple(x.shape)} {x.dtype} and weight "
                         f"{tuple(weight.shape)} {weight.dtype} are not one [1, K] row and a "
                         "row-contiguous [N, K] weight of its dtype")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"dense_gemv: bias {tuple(bias.shape)} for {weight.shape[0]} outputs")
    x = x.contiguous()
    n, k = weight.shape
    if config is None:
        config = TUNER.choose(tune_key(n=n, k=k, m=1, dtype=x.dtype), x.device,
                              default_config(n, k), candidate_configs(),
                              lambda c: launch(x, weight, bias, c))
    return launch(x, weight, bias, config)
