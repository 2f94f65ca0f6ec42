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

from octavo.kernels.triton.cache_write import check_last_dim_contiguous
from octavo.kernels.triton.rmsnorm import emulate_bf16_rounding, round_to

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
):
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
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x shape {tuple(x.shape)} needs an even last dimension [..., 2 * d]")
    check_last_dim_contiguous(x=x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x.view(1, -1) if x.dim() == 1 else x.flatten(0, -2)  # [num_rows, 2 * d]
    if rows.shape[0] == 0 or d == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
        rows,
        out,
        rows.stride(0),
        d,
        BLOCK=block,
        EMULATE_BF16=emulate_bf16_rounding(),
        num_warps=max(1, min(4, block // 256)),
        enable_fp_fusion=False,  # no FMA contraction: same roundings as torch's eager ops
    )
    return out
