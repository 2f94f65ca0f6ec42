"""Batched LoRA for one linear layer: ``y[t] += (x[t] @ A[s]^T) @ B[s]^T`` per adapter slot.

Two kernels over the step's rows grouped by slot (``octavo.lora.layers.LoRAMapping``: flat
token indices sorted by slot, each group one slot):

- shrink: ``h[i] = x[token_indices[i]] @ A[slot]^T`` for every grouped row ``i``, float32,
  ``[num_lora_tokens, R]``; grid ``[num_groups, cdiv(max_group_size, BLOCK_M), split_k]``,
  each program ``BLOCK_M`` rows of one group, the whole (padded) rank, looping over one
  ``SHRINK_K_CHUNK`` of the inputs and adding its partial sums atomically (without the split
  a few row blocks looped over all of K: 16 busy programs for a 256-row step of 4 adapters
  on a 132-SM GPU).
- expand: ``y[token_indices[i]] += h[i] @ B[slot]^T``; grid ``[num_groups,
  cdiv(max_group_size, BLOCK_M), cdiv(N, BLOCK_N)]``. Every row is in one group, so each
  output element is written by one program (no atomics).

Rows of no adapter are in no group and are not touched. Gathering rows by index serves
decode (one row per request, many requests per slot) as well as prefill (long runs).
Reference: ``octavo.lora.layers.lora_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import dot_fp32, upcast_dot

# Inputs per shrink program (a multiple of every block_k used): K = 4096 splits in 8.
SHRINK_K_CHUNK = 512


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, token_ptr, slot_ptr, start_ptr,
    K, R, k_chunk,
    stride_xm, stride_as, stride_ar, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    group = tl.program_id(0)
    block = tl.program_id(1)
    k_start = tl.program_id(2) * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    start = tl.load(start_ptr + group)
    end = tl.load(start_ptr + group + 1)
    first = start + block * BLOCK_M
    if first >= end:
        return
    slot = tl.load(slot_ptr + group).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)  # positions in the grouped order
    row_mask = rows < end
    tokens = tl.load(token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [M, K]
        a = tl.load(a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
                    mask=rank_mask[None, :] & k_mask[:, None], other=0.0)  # [K, R]
        acc += dot_fp32(x, a, UPCAST, PRECISION)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + ranks[None, :]
    h_mask = row_mask[:, None] & rank_mask[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=h_mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=h_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, token_ptr, slot_ptr, start_ptr,
    N, R,
    stride_hm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    group = tl.program_id(0)
    block = tl.program_id(1)
    block_n = tl.program_id(2)
    start = tl.load(start_ptr + group)
    end = tl.load(start_ptr + group + 1)
    first = start + block * BLOCK_M
    if first >= end:
        return
    slot = tl.load(slot_ptr + group).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    tokens = tl.load(token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hm + ranks[None, :],
                mask=row_mask[:, None] & rank_mask[None, :], other=0.0)  # [M, R] float32
    b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
                mask=col_mask[None, :] & rank_mask[:, None], other=0.0)  # [R, N]
    delta = dot_fp32(h.to(b.dtype), b, UPCAST, PRECISION)  # [M, N]
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_shrink_expand(
    x: torch.Tensor,  # [num_tokens, K]
    out: torch.Tensor,  # [num_tokens, N], updated in place
    lora_a: torch.Tensor,  # [slots, R, K]
    lora_b: torch.Tensor,  # [slots, N, R]
    token_indices: torch.Tensor,  # [num_lora_tokens] rows grouped by slot
    group_slots: torch.Tensor,  # [num_groups] int32
    group_starts: torch.Tensor,  # [num_groups + 1] int32
    num_groups: int,
    max_group_size: int,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> None:
    """``out[t] += (x[t] @ lora_a[s]^T) @ lora_b[s]^T`` for every grouped row ``t`` of slot
    ``s`` (see the module docstring)."""
    num_lora_tokens = token_indices.shape[0]
    if num_groups == 0 or num_lora_tokens == 0:
        return
    K, N, R = x.shape[1], out.shape[1], lora_a.shape[1]
    assert lora_a.shape[2] == K and lora_b.shape[1] == N and lora_b.shape[2] == R, (
        f"LoRA shapes A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit "
        f"x {tuple(x.shape)} -> out {tuple(out.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    assert out.stride(1) == 1, "out must be contiguous in its last dimension"
    block_r = max(16, triton.next_power_of_2(R))
    precision = "ieee"  # (fp32 exactly; 16-bit operands ignore it)
    upcast = upcast_dot(x.dtype)
    split_k = triton.cdiv(K, SHRINK_K_CHUNK)
    make = torch.empty if split_k == 1 else torch.zeros
    shrunk = make(num_lora_tokens, R, dtype=torch.float32, device=x.device)
    blocks_m = triton.cdiv(max_group_size, block_m)
    _lora_shrink_kernel[(num_groups, blocks_m, split_k)](
        x, lora_a, shrunk, token_indices, group_slots, group_starts,
        K, R, SHRINK_K_CHUNK,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k,
        UPCAST=upcast, PRECISION=precision,
    )
    _lora_expand_kernel[(num_groups, blocks_m, triton.cdiv(N, block_n))](
        shrunk, lora_b, out, token_indices, group_slots, group_starts,
        N, R,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        UPCAST=upcast, PRECISION=precision,
    )
