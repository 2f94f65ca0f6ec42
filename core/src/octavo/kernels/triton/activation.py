"""SiLU-gated activation of the feed-forward block: ``silu(gate) * up`` in one pass.

Reference: ``octavo.model_executor.layers.activation.SiluAndMul.forward_native``, i.e.
``F.silu(x[..., :d]) * x[..., d:]``: silu is computed in float32 and rounded to the input
dtype, then the product is rounded again, as torch's two eager ops do. ``exp`` and the division
may differ from torch's in the last float32 bit, so 16-bit results can differ by one unit in
the last place.

Grid: ``(num_rows, cdiv(d, BLOCK))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import (
    KERNELS_INTERPRETED,
    cdiv,
    check_last_dim_contiguous,
    next_power_of_2,
)
from octavo.kernels.triton.pdl import pdl_begin, pdl_launch
from octavo.kernels.triton.rmsnorm import round_to

# Most output columns one program computes.
_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d] (row stride stride_x_row)
    out_ptr,  # [num_rows, d] contiguous
    stride_x_row,
    d,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + cols, mask=mask, other=0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype, EMULATE_BF16)  # F.silu(gate)
    out = round_to(silu * up, dtype, EMULATE_BF16)
    tl.store(out_ptr + row * d + cols, out.to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
    """``silu(x[..., :d]) * x[..., d:]`` as a new contiguous tensor of ``x``'s dtype.

    ``x``'s last dimension must be contiguous; its rows may be strided (inputs with more than
    two dimensions whose rows cannot be flattened as a view are copied first).
    """
    dim = x.dim()
    if dim == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x shape {tuple(x.shape)} needs an even last dimension [..., 2 * d]")
    if x.stride(-1) != 1:
        check_last_dim_contiguous(x=x)
    d = x.shape[-1] // 2
    if dim == 2:  # the usual case: rows as they are (a view of them costs ~1 µs a launch)
        rows, num_rows = x, x.shape[0]  # [num_rows, 2 * d]
        out = x.new_empty((num_rows, d))
    else:
        rows = x.view(1, -1) if dim == 1 else x.flatten(0, -2)  # [num_rows, 2 * d]
        num_rows = rows.shape[0]
        out = x.new_empty((*x.shape[:-1], d))
    if num_rows == 0 or d == 0:
        return out
    block = min(_MAX_BLOCK, next_power_of_2(d))
    _silu_and_mul_kernel[(num_rows, cdiv(d, block))](
        rows,
        out,
        rows.stride(0),
        d,
        BLOCK=block,
        EMULATE_BF16=KERNELS_INTERPRETED,
        **pdl_launch(x.device),
        num_warps=max(1, min(4, block // 256)),
        enable_fp_fusion=False,  # no FMA contraction: same roundings as torch's eager ops
    )
    return out
