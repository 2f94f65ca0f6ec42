"""RMSNorm, alone or fused with the residual add before it, plus the rounding helper that the
fused elementwise kernels (``rotary``, ``activation``) share.

Reference: ``octavo.model_executor.layers.rmsnorm.RMSNorm.forward_native``. The kernels repeat
its arithmetic step by step, rounding to the same dtype after the same operations:

- ``summed = x + residual``, rounded to the promoted dtype of ``x`` and ``residual``;
- ``normed = (float32(summed) * rsqrt(mean(float32(summed) ** 2) + eps))``, rounded to that dtype;
- ``out = weight * normed``, computed in float32 and rounded to ``promote(weight, summed)``.

Only the float32 sum of squares may differ from torch's in its last bits (reduction order),
which can move a 16-bit result by one unit in the last place.

Helper shared with the other elementwise kernels: ``round_to`` (float32 -> storage dtype with
round-to-nearest-even, also under the CPU interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import (
    KERNELS_INTERPRETED,
    check_last_dim_contiguous,
    next_power_of_2,
)
from octavo.kernels.triton.pdl import pdl_begin, pdl_launch


def emulate_bf16_rounding() -> bool:
    """Whether ``round_to`` must round float32 -> bfloat16 by hand.

    The Triton 3.9 CPU interpreter truncates float32 -> bfloat16 casts (even with
    ``fp_downcast_rounding="rtne"``), where GPUs and torch round to nearest even. Compiled
    kernels always use the native cast. (A constant of the process: Triton chooses the
    interpreter when the kernels are defined.)
    """
    return KERNELS_INTERPRETED


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Float32 ``x`` rounded to ``dtype`` (round to nearest even), returned as float32.

    The value is what torch gets when an eager op stores its float32 result in ``dtype``;
    ``EMULATE_BF16`` (see ``emulate_bf16_rounding``) rounds bf16 with integer ops instead of a
    cast. NaN/inf inputs are not expected there (the bit trick may turn a NaN into inf).
    """
    if EMULATE_BF16 and dtype == tl.bfloat16:  # static: resolved at compile time
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round half to even at bit 16
        bits = (bits >> 16) << 16
        rounded = bits.to(tl.float32, bitcast=True)
    else:
        rounded = x.to(dtype).to(tl.float32)
    return rounded


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_outer, num_inner, hidden_size] (strided rows)
    residual_ptr,  # like x_ptr (read when HAS_RESIDUAL)
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_rows, hidden_size] contiguous
    new_residual_ptr,  # [num_rows, hidden_size] contiguous (written when HAS_RESIDUAL)
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    num_inner,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden_size
    EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per row: ``weight * norm(x [+ residual])`` over the whole row in one tile."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    outer = row // num_inner
    inner = row % num_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size

    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols,
            mask=mask,
            other=0,
        )
        sum_dtype = new_residual_ptr.dtype.element_ty
        x = round_to(x + residual.to(tl.float32), sum_dtype, EMULATE_BF16)  # x + residual
        tl.store(new_residual_ptr + row * hidden_size + cols, x.to(sum_dtype), mask=mask)
        norm_dtype = sum_dtype
    else:
        norm_dtype = x_ptr.dtype.element_ty

    variance = tl.sum(x * x, axis=0) / hidden_size  # padded columns are 0
    normed = round_to(x * tl.math.rsqrt(variance + eps), norm_dtype, EMULATE_BF16)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    out = round_to(weight * normed, out_dtype, EMULATE_BF16)
    tl.store(out_ptr + row * hidden_size + cols, out.to(out_dtype), mask=mask)


def _rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """``x``'s rows as the kernel walks them: ``(tensor, num_outer, num_inner, stride_outer,
    stride_inner)``, the rows being ``tensor[outer, inner]`` (a 3-D view, as ``x.unsqueeze(1)``
    would give for a 2-D ``x``, without making one: that view costs ~1 µs a launch; a copy
    only for > 3-D inputs that cannot be flattened as a view)."""
    dim = x.dim()
    if dim == 2:
        return x, x.shape[0], 1, x.stride(0), x.shape[1] * x.stride(1)
    if dim == 3:
        return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    rows = x.view(1, 1, -1) if dim == 1 else x.flatten(0, -3)
    return rows, rows.shape[0], rows.shape[1], rows.stride(0), rows.stride(1)


def _num_warps(block: int) -> int:
    """Warps for a one-row tile of ``block`` elements (about 8 elements per thread)."""
    return max(1, min(16, block // 256))


def _norm_inputs_ok(x: torch.Tensor, weight: torch.Tensor,
                    residual: torch.Tensor | None = None) -> bool:
    """The cheap test of ``_check_norm_inputs`` (one expression, no error message built)."""
    device = x.device
    return (weight.shape == x.shape[-1:] and weight.device == device and x.stride(-1) == 1
            and weight.stride(-1) == 1
            and (residual is None or (residual.shape == x.shape and residual.device == device
                                      and residual.stride(-1) == 1)))


def _check_norm_inputs(x: torch.Tensor, weight: torch.Tensor, **others: torch.Tensor) -> None:
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden_size},)")
    for name, tensor in others.items():
        if tensor.shape != x.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != x shape {tuple(x.shape)}")
    for name, tensor in {"weight": weight, **others}.items():
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
    check_last_dim_contiguous(x=x, weight=weight, **others)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    new_residual: torch.Tensor | None,
) -> None:
    rows, num_outer, num_inner, stride_outer, stride_inner = _rows_of(x)
    if residual is None:
        res_rows, stride_r_outer, stride_r_inner = rows, stride_outer, stride_inner
    else:
        res_rows, _, _, stride_r_outer, stride_r_inner = _rows_of(residual)
    num_rows = num_outer * num_inner
    if num_rows == 0:
        return
    hidden_size = x.shape[-1]
    block = next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        rows,
        res_rows,
        weight,
        out,
        out if new_residual is None else new_residual,
        stride_outer,
        stride_inner,
        stride_r_outer,
        stride_r_inner,
        num_inner,
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        EMULATE_BF16=KERNELS_INTERPRETED,
        **pdl_launch(x.device),
        num_warps=_num_warps(block),
        enable_fp_fusion=False,  # no FMA contraction: same roundings as torch's eager ops
    )


def rms_norm(
    x: torch.Tensor,  # [..., hidden_size], last dim contiguous
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> torch.Tensor:  # [..., hidden_size] contiguous, dtype promote(x, weight)
    """``weight * (x / rms(x))`` over the last dimension, as ``RMSNorm`` computes it.

    Returns a new tensor; ``x`` may be any strided view (e.g. the query heads of a fused QKV
    output) as long as its last dimension is contiguous.
    """
    if not _norm_inputs_ok(x, weight):
        _check_norm_inputs(x, weight)
        raise AssertionError("_check_norm_inputs passed inputs the fast test refused")
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden_size], last dim contiguous
    residual: torch.Tensor,  # [..., hidden_size], last dim contiguous
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass, as ``RMSNorm(x, residual)``.

    Both results are new contiguous tensors (the inputs are left untouched): the sum has the
    promoted dtype of ``x`` and ``residual``, the normed output ``promote(sum, weight)``.
    """
    if not _norm_inputs_ok(x, weight, residual):
        _check_norm_inputs(x, weight, residual=residual)
        raise AssertionError("_check_norm_inputs passed inputs the fast test refused")
    dtype = x.dtype
    if residual.dtype == dtype and weight.dtype == dtype:  # the usual case: no promotion
        sum_dtype = out_dtype = dtype
    else:
        sum_dtype = torch.promote_types(dtype, residual.dtype)
        out_dtype = torch.promote_types(sum_dtype, weight.dtype)
    new_residual = torch.empty_like(x, dtype=sum_dtype, memory_format=torch.contiguous_format)
    out = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual
