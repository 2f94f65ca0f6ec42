"""Per-token fp8 (e4m3) quantization of activations in one kernel.

``quantize_fp8_per_token(x)``: ``[M, K]`` -> (e4m3 ``[M, K]``, float32 ``[M, 1]`` scales) with
``scale = max(amax(|x_row|) * float32(1 / 448), MIN_SCALE)`` and ``q = e4m3(x / scale)``
saturated, the values of ``octavo.kernels.fp8.quantize_fp8_per_token`` bit for bit: the
division is correctly rounded (``div_rn``, as torch's tensor division) and the rounding to
e4m3 is ``round_to_e4m3``'s exact arithmetic.

The torch ops it replaces take about eleven passes over the activations (abs, amax, upcast,
divide, clamp, cast, each writing its result); one program per row here reads the row twice
(the second time mostly from L2) and writes one byte per element, which matters for the
``torch._scaled_mm`` path's large-M steps (a prefill chunk of thousands of tokens at every
linear layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import round_to_e4m3


@triton.jit
def _per_token_kernel(
    x_ptr,  # [M, K]
    out_ptr,  # e4m3 [M, K]
    scale_ptr,  # float32 [M]
    K,
    stride_x,
    stride_out,
    inv_fp8_max,  # float32(1 / 448)
    min_scale,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    out_row = out_ptr + row * stride_out
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = ks < K
        x = tl.load(x_row + ks, mask=mask, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.math.div_rn(x, scale))
        tl.store(out_row + ks, q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_per_token(
    x: torch.Tensor, inv_fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [M, K], float32 [M, 1])
    """Dynamic per-token quantization of ``x [M, K]`` (see the module docstring); scales are
    at least ``min_scale`` (an all-zero row divides by it, not by zero)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _per_token_kernel[(m,)](x, out, scale, k, x.stride(0), out.stride(0), inv_fp8_max,
                                min_scale,
                                BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4)
    return out, scale
