"""Fused mixture-of-experts feed-forward: every token through its top-k experts in two launches.

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes, for each token ``t``,

    sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
    e = topk_ids[t, j]

The ``T * top_k`` (token, slot) *assignments* are grouped by expert and each expert's group is
padded to a multiple of ``block_m`` (``moe_align_block_size``, torch ops with static shapes and
no host sync, so the whole forward can be captured in a CUDA graph). Then two grouped GEMMs run
over (row block, column block) tiles, every row block belonging to one expert:

1. ``_gate_up_kernel``: gathers the block's token rows of ``x`` and multiplies them by the
   expert's gate and up rows of ``w13`` (two accumulators in one program), writing
   ``silu(gate) * up`` for each assignment: ``[T * top_k, I]``.
2. ``_down_kernel``: multiplies those rows by the expert's ``w2`` and scales each by its routing
   weight: ``[T * top_k, H]``; the top-k rows of a token are then summed (in float32, in a fixed
   order, so results do not depend on scheduling).

Row blocks past the padded total exit at once, so the grid is sized by an upper bound that
depends only on ``T``, ``top_k``, the number of experts and ``block_m``. Experts that get no
token cost nothing.

Rounding follows the eager ops of ``octavo.model_executor.layers.fused_moe.fused_moe_native``:
the projections' outputs, ``silu`` and the product are rounded to the input dtype, the weighted
down projection once more; the sum over the top-k is in float32, rounded at the end.

Reference: ``octavo.model_executor.layers.fused_moe.fused_moe_reference`` (a plain loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import dot_fp32, upcast_dot
from octavo.kernels.triton.rmsnorm import emulate_bf16_rounding, round_to


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True, slots=True)
class MoELaunchConfig:
    """Tile sizes and launch settings of the two grouped GEMMs (powers of two, >= 16 for the
    block sizes: ``tl.dot``'s smallest tile)."""

    # Assignment rows per tile; also the padding unit of every expert's group of rows.
    block_m: int = 64
    # Output columns per tile (of I for gate/up, of H for down).
    block_n: int = 64
    # Reduction step (over H for gate/up, over I for down).
    block_k: int = 64
    # Row blocks that walk the same column blocks together (L2 reuse of weight tiles).
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # tl.dot input_precision for float32 inputs ("ieee", "tf32", "tf32x3").
    fp32_dot_precision: str = "ieee"

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not _is_power_of_two(value) or value < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.group_m < 1 or not _is_power_of_two(self.num_warps) or self.num_stages < 1:
            raise ValueError(f"invalid launch settings {self}")


def default_moe_config(num_tokens: int, num_experts: int, top_k: int) -> MoELaunchConfig:
    """A launch config by the expected rows per expert (``num_tokens * top_k / num_experts``).

    Few rows per expert (decode): 16-row tiles waste little padding and the kernel is a stream
    of weight tiles, so wide reduction steps. Many rows (prefill): 64-row tiles, compute-bound.
    Not tuned per GPU yet (``benchmarks/kernels/bench_fused_moe.py`` sweeps candidates).
    """
    rows_per_expert = num_tokens * top_k / max(1, num_experts)
    if rows_per_expert <= 16:
        return MoELaunchConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_stages=4)
    if rows_per_expert <= 64:
        return MoELaunchConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_stages=3)
    return MoELaunchConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8,
                           num_stages=3)


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Most rows the expert-grouped, block-padded assignments can take: every used expert
    (at most ``min(num_experts, num_assignments)``) wastes fewer than ``block_m`` rows."""
    bound = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids in [0, num_experts)
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flat assignments ``topk_ids.flatten()`` by expert, each group padded to a
    multiple of ``block_m``.

    Returns ``(sorted_ids, block_expert, num_padded)``:

    - ``sorted_ids`` ``[max_padded_rows]`` int32: assignment indices (``token * top_k + slot``)
      expert by expert, in token order within an expert; padding holds ``num_assignments``;
    - ``block_expert`` ``[max_padded_rows / block_m]`` int32: the expert of each row block
      (blocks past the padded total repeat the last expert and must be skipped);
    - ``num_padded`` ``[1]`` int32: the padded total, a multiple of ``block_m``.

    Static shapes and no host synchronisation (CUDA-graph safe).
    """
    device = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)  # [A]
    num_assignments = flat.numel()
    size = max_padded_rows(num_assignments, num_experts, block_m)
    order = torch.argsort(flat, stable=True)  # [A] assignments grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)  # [E]
    padded_starts = padded_ends - padded_counts
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_assignments, device=device) - starts[sorted_experts]
    sorted_ids = torch.full((size,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, padded_starts[sorted_experts] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_ends[-1:].to(torch.int32)


@triton.jit
def _tile_of(pid, num_blocks_m, num_blocks_n, GROUP_M: tl.constexpr):
    """``(row block, column block)`` of program ``pid``, ``GROUP_M`` row blocks at a time."""
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, K] hidden states
    w_ptr,  # [num_experts, 2 * N, K]: gate rows [0, N), up rows [N, 2N)
    out_ptr,  # [num_assignments, N] silu(gate) * up
    sorted_ids_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_padded / BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    N,
    K,
    num_assignments,
    top_k,
    num_blocks_m,
    stride_x_token,
    stride_w_expert,
    stride_w_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)  # [BLOCK_M] assignment indices
    row_mask = ids < num_assignments
    tokens = (ids // top_k).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_x_token + ks[None, :]  # [BLOCK_M, BLOCK_K]
    gate_ptrs = (w_ptr + expert * stride_w_expert + cols[None, :].to(tl.int64) * stride_w_row
                 + ks[:, None])  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + N * stride_w_row
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate += dot_fp32(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), UPCAST_DOT,
                         DOT_PRECISION)
        up += dot_fp32(x, tl.load(up_ptrs, mask=w_mask, other=0.0), UPCAST_DOT, DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    gate = round_to(gate, dtype, EMULATE_BF16)  # the projections' outputs, as stored
    up = round_to(up, dtype, EMULATE_BF16)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype, EMULATE_BF16)
    act = round_to(silu * up, dtype, EMULATE_BF16)
    out_ptrs = out_ptr + ids[:, None].to(tl.int64) * stride_out_row + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [num_assignments, K] silu(gate) * up
    w_ptr,  # [num_experts, N, K]
    out_ptr,  # [num_assignments, N] routing weight * (w2 @ act)
    weights_ptr,  # [num_assignments] float32 routing weights
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    num_assignments,
    num_blocks_m,
    stride_act_row,
    stride_w_expert,
    stride_w_row,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    row_mask = ids < num_assignments
    ids = ids.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)

    act_ptrs = act_ptr + ids[:, None] * stride_act_row + ks[None, :]
    w_ptrs = (w_ptr + expert * stride_w_expert + cols[None, :].to(tl.int64) * stride_w_row
              + ks[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - k * BLOCK_K
        a = tl.load(act_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += dot_fp32(a, w, UPCAST_DOT, DOT_PRECISION)
        act_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + ids, mask=row_mask, other=0.0)  # [BLOCK_M] float32
    out = round_to(round_to(acc, dtype, EMULATE_BF16) * weight[:, None], dtype, EMULATE_BF16)
    out_ptrs = out_ptr + ids[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


def _check_inputs(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if (hidden != x.shape[1] or two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2)):
        raise ValueError(
            f"shapes do not agree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)} (expected w13 [E, 2I, H], w2 [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[:1] != x.shape[:1]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{x.shape[0]}, top_k]")
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} is {tensor.dtype}, x is {x.dtype}: one dtype for all")


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] routing weights
    topk_ids: torch.Tensor,  # [num_tokens, top_k] expert ids in [0, num_experts)
    config: MoELaunchConfig | None = None,
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """The weighted sum of each token's top-k experts' SiLU-gated MLPs (see the module doc).

    ``config`` defaults to ``default_moe_config`` for the shapes. Expert ids outside
    ``[0, num_experts)`` are not checked (that would need a host sync); they give undefined
    results.
    """
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_assignments = num_tokens * top_k
    if num_assignments == 0:
        return torch.zeros_like(x)
    config = config or default_moe_config(num_tokens, num_experts, top_k)
    sorted_ids, block_expert, num_padded = moe_align_block_size(
        topk_ids, num_experts, config.block_m)
    num_blocks_m = block_expert.shape[0]
    common = dict(
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, UPCAST_DOT=upcast_dot(x.dtype),
        DOT_PRECISION=config.fp32_dot_precision, EMULATE_BF16=emulate_bf16_rounding(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )

    act = torch.empty((num_assignments, intermediate), dtype=x.dtype, device=x.device)
    grid = (num_blocks_m * triton.cdiv(intermediate, config.block_n),)
    _gate_up_kernel[grid](
        x, w13, act, sorted_ids, block_expert, num_padded,
        intermediate, hidden, num_assignments, top_k, num_blocks_m,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        **common,
    )
    weights = topk_weights.to(torch.float32).contiguous().view(-1)  # [num_assignments]
    out = torch.empty((num_assignments, hidden), dtype=x.dtype, device=x.device)
    grid = (num_blocks_m * triton.cdiv(hidden, config.block_n),)
    _down_kernel[grid](
        act, w2, out, weights, sorted_ids, block_expert, num_padded,
        hidden, intermediate, num_assignments, num_blocks_m,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        **common,
    )
    # [num_tokens, top_k, hidden] -> [num_tokens, hidden]: a fixed-order float32 sum.
    return out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
