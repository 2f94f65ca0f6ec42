"""Rotary position embedding ("neox" halves) of the query and key heads, in one launch.

Reference: ``octavo.model_executor.layers.rotary.RotaryEmbedding.forward_native``. For each
token at position ``p`` and each head, with ``d = head_dim // 2``, ``cos = table[p, :d]`` and
``sin = table[p, d:]`` (``table`` is the layer's ``cos_sin_cache``)::

    out[:d] = x[:d] * cos - x[d:] * sin
    out[d:] = x[d:] * cos + x[:d] * sin

computed like torch's eager ops: ``cos``/``sin`` rounded to the head's dtype first, and every
product and sum rounded to that dtype, so results match the torch path exactly (float32 and,
on GPU or with ``round_to``'s emulation, 16-bit dtypes too).

Grid: ``(num_tokens, query head blocks + key head blocks)``; each program rotates up to
``BLOCK_H`` heads of one token, of either the query or the key.

``apply_rotary_write_kv`` is the same launch that also stores each token's rotated key heads
and its value heads in the paged KV cache at the token's slot (what
``octavo.kernels.triton.cache_write.write_kv_cache`` does after an ``apply_rotary``, for caches
of the key's dtype): one kernel a layer fewer, and the rotated keys are never written
anywhere else.
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

# Most heads one program rotates (query and key heads are never mixed in one program).
_MAX_BLOCK_H = 16


@triton.jit
def _rotate_heads(
    src_ptr,  # this token's first head, [heads, head_dim] with stride_src_head
    dst_ptr,  # this token's first output head, [heads, head_dim] with stride_dst_head
    stride_src_head,
    stride_dst_head,
    first_head,
    num_heads,
    cos,  # [HALF_PADDED] float32 (table dtype)
    sin,  # [HALF_PADDED] float32
    dims,  # [HALF_PADDED] arange
    half_dim,
    BLOCK_H: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """Rotate heads ``first_head .. first_head + BLOCK_H`` (those ``< num_heads``)."""
    dtype = dst_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half_dim)  # [BLOCK_H, HALF_PADDED]
    src = src_ptr + heads[:, None] * stride_src_head + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0).to(tl.float32)  # [BLOCK_H, HALF_PADDED]
    x2 = tl.load(src + half_dim, mask=mask, other=0).to(tl.float32)
    cos = round_to(cos, dtype, EMULATE_BF16)[None, :]  # cos.to(x.dtype)
    sin = round_to(sin, dtype, EMULATE_BF16)[None, :]
    out1 = round_to(
        round_to(x1 * cos, dtype, EMULATE_BF16) - round_to(x2 * sin, dtype, EMULATE_BF16),
        dtype,
        EMULATE_BF16,
    )
    out2 = round_to(
        round_to(x2 * cos, dtype, EMULATE_BF16) + round_to(x1 * sin, dtype, EMULATE_BF16),
        dtype,
        EMULATE_BF16,
    )
    dst = dst_ptr + heads[:, None] * stride_dst_head + dims[None, :]
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + half_dim, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int32/int64
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,  # [num_tokens, num_heads, head_dim] (may be q_ptr: in place)
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim] (may be k_ptr: in place)
    cos_sin_ptr,  # [max_positions, head_dim] cos | sin halves
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_qo_token,
    stride_qo_head,
    stride_ko_token,
    stride_ko_head,
    stride_cache_pos,
    num_heads,
    num_kv_heads,
    num_q_blocks,  # cdiv(num_heads, BLOCK_H); later head blocks are key blocks
    half_dim,
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] (read when WRITE_CACHE)
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (written when WRITE_CACHE)
    slot_mapping_ptr,  # [num_tokens] int64, < 0 = padding (read when WRITE_CACHE)
    stride_v_token,
    stride_v_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_H: tl.constexpr,
    HALF_PADDED: tl.constexpr,  # next power of two >= half_dim
    EMULATE_BF16: tl.constexpr,
    WRITE_CACHE: tl.constexpr,  # keys rotated into the cache (not k_out), values copied there
    CACHE_BLOCK_SIZE: tl.constexpr,  # tokens per cache block (when WRITE_CACHE)
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    dim_mask = dims < half_dim
    row = cos_sin_ptr + position * stride_cache_pos
    cos = tl.load(row + dims, mask=dim_mask, other=0).to(tl.float32)
    sin = tl.load(row + half_dim + dims, mask=dim_mask, other=0).to(tl.float32)
    if head_block < num_q_blocks:
        _rotate_heads(
            q_ptr + token * stride_q_token,
            q_out_ptr + token * stride_qo_token,
            stride_q_head,
            stride_qo_head,
            head_block * BLOCK_H,
            num_heads,
            cos,
            sin,
            dims,
            half_dim,
            BLOCK_H,
            EMULATE_BF16,
        )
    else:
        first_head = (head_block - num_q_blocks) * BLOCK_H
        if WRITE_CACHE:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            if slot < 0:  # a padding token: nothing to store
                return
            k_dst = (cache_ptr + (slot // CACHE_BLOCK_SIZE) * stride_cache_block
                     + (slot % CACHE_BLOCK_SIZE) * stride_cache_slot)
            stride_k_dst = stride_cache_head
        else:
            k_dst = k_out_ptr + token * stride_ko_token
            stride_k_dst = stride_ko_head
        _rotate_heads(
            k_ptr + token * stride_k_token,
            k_dst,
            stride_k_head,
            stride_k_dst,
            first_head,
            num_kv_heads,
            cos,
            sin,
            dims,
            half_dim,
            BLOCK_H,
            EMULATE_BF16,
        )
        if WRITE_CACHE:  # the value heads to the same slot, unchanged but for the dtype
            heads = first_head + tl.arange(0, BLOCK_H)
            mask = (heads[:, None] < num_kv_heads) & dim_mask[None, :]  # [BLOCK_H, HALF_PADDED]
            src = (value_ptr + token * stride_v_token + heads[:, None] * stride_v_head
                   + dims[None, :])
            dst = k_dst + stride_cache_kv + heads[:, None] * stride_cache_head + dims[None, :]
            cache_dtype = cache_ptr.dtype.element_ty
            tl.store(dst, tl.load(src, mask=mask).to(cache_dtype), mask=mask)
            tl.store(dst + half_dim, tl.load(src + half_dim, mask=mask).to(cache_dtype),
                     mask=mask)


def apply_rotary(
    positions: torch.Tensor,  # [num_tokens] int64 (or int32), each < max_positions
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos | sin halves (float32)
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key`` by their tokens' positions; returns ``(query, key)``.

    ``inplace=False`` (what ``RotaryEmbedding`` uses) returns new contiguous tensors and leaves
    the inputs untouched; ``inplace=True`` overwrites ``query``/``key`` and returns them.
    ``query``/``key`` may be strided views (e.g. of a fused QKV projection output); only their
    last dimension must be contiguous. Positions are not range-checked (that would need a host
    sync): one ``>= max_positions`` reads outside the table.
    """
    device = query.device
    if (query.dim() != 3 or key.dim() != 3 or key.shape[0] != query.shape[0]
            or key.shape[2] != query.shape[2] or positions.shape != query.shape[:1]
            or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != query.shape[2]
            or query.shape[2] % 2 != 0 or positions.device != device or key.device != device
            or cos_sin_cache.device != device or query.stride(-1) != 1 or key.stride(-1) != 1
            or cos_sin_cache.stride(-1) != 1):
        _check_rotary_inputs(positions, query, key, cos_sin_cache)
        raise AssertionError("_check_rotary_inputs passed inputs the fast test refused")
    num_tokens = query.shape[0]
    if inplace:
        q_out, k_out = query, key
    else:
        q_out = torch.empty_like(query, memory_format=torch.contiguous_format)
        k_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    _launch(positions, query, key, q_out, k_out, cos_sin_cache, None, None, None)
    return q_out, k_out


def apply_rotary_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64 (or int32), each < max_positions
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]: cos | sin halves (float32)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], key's dtype
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = padding, skipped
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: the rotated query (a new tensor)
    """``apply_rotary`` of ``query`` and ``key``, with the rotated key heads and the ``value``
    heads stored in ``kv_cache`` at ``slot_mapping`` in the same launch (``write_kv_cache``'s
    contract, for a cache of the key's dtype; fp8 caches take ``write_kv_cache``). ``key`` and
    ``value`` are left untouched; ``query``, ``key`` and ``value`` may be strided views."""
    if (value.shape != key.shape or key.dim() != 3 or kv_cache.dim() != 5
            or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]
            or slot_mapping.shape != query.shape[:1] or kv_cache.dtype != key.dtype
            or value.device != query.device or kv_cache.device != query.device
            or slot_mapping.device != query.device or value.stride(-1) != 1
            or kv_cache.stride(-1) != 1):
        apply_rotary_write_kv_check(query, key, value, kv_cache, slot_mapping)
        raise AssertionError("apply_rotary_write_kv_check passed inputs the fast test refused")
    if (positions.shape != query.shape[:1] or cos_sin_cache.dim() != 2
            or cos_sin_cache.shape[1] != query.shape[2] or query.shape[2] % 2 != 0
            or positions.device != query.device or cos_sin_cache.device != query.device
            or query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1):
        _check_rotary_inputs(positions, query, key, cos_sin_cache)
        raise AssertionError("_check_rotary_inputs passed inputs the fast test refused")
    q_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0]:
        _launch(positions, query, key, q_out, key, cos_sin_cache, value, kv_cache, slot_mapping)
    return q_out


def apply_rotary_write_kv_check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``ValueError`` unless ``apply_rotary_write_kv`` takes these tensors (its cache part;
    the rotary part is ``apply_rotary``'s)."""
    num_tokens = query.shape[0]
    if (value.shape != key.shape or key.dim() != 3 or kv_cache.dim() != 5
            or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]
            or slot_mapping.shape != (num_tokens,)):
        raise ValueError(
            f"rotary with cache write: key {tuple(key.shape)} and value {tuple(value.shape)} "
            f"must be [{num_tokens}, num_kv_heads, head_dim] and the cache "
            f"{tuple(kv_cache.shape)} [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"slot_mapping {tuple(slot_mapping.shape)} [{num_tokens}]")
    if kv_cache.dtype != key.dtype:
        raise ValueError(f"rotary with cache write: the cache is {kv_cache.dtype}, the keys "
                         f"{key.dtype} (fp8 caches take write_kv_cache)")
    for name, tensor in {"key": key, "value": value, "kv_cache": kv_cache,
                         "slot_mapping": slot_mapping}.items():
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}")
    check_last_dim_contiguous(value=value, kv_cache=kv_cache)


def _launch(positions, query, key, q_out, k_out, cos_sin_cache, value, kv_cache,
            slot_mapping) -> None:
    """One launch of ``_rotary_kernel`` (``kv_cache`` given: the cache-writing variant)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    block_h = min(_MAX_BLOCK_H, next_power_of_2(max(num_heads, num_kv_heads)))
    num_q_blocks = cdiv(num_heads, block_h)
    num_k_blocks = cdiv(num_kv_heads, block_h)
    write_cache = kv_cache is not None
    if write_cache:
        cache_strides = kv_cache.stride()[:4]  # [K/V, block, offset, head]
        value_strides = value.stride()[:2]
    else:
        kv_cache, value, slot_mapping = key, key, positions  # not read
        cache_strides, value_strides = (0, 0, 0, 0), (0, 0)
    _rotary_kernel[(num_tokens, num_q_blocks + num_k_blocks)](
        positions,
        query,
        key,
        q_out,
        k_out,
        cos_sin_cache,
        *query.stride()[:2],
        *key.stride()[:2],
        *q_out.stride()[:2],
        *k_out.stride()[:2],
        cos_sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        num_q_blocks,
        head_dim // 2,
        value,
        kv_cache,
        slot_mapping,
        *value_strides,
        *cache_strides,
        BLOCK_H=block_h,
        HALF_PADDED=next_power_of_2(head_dim // 2),
        EMULATE_BF16=KERNELS_INTERPRETED,
        WRITE_CACHE=write_cache,
        CACHE_BLOCK_SIZE=kv_cache.shape[2] if write_cache else 1,
        **pdl_launch(query.device),
        num_warps=4 if block_h * head_dim >= 1024 else 1,
        enable_fp_fusion=False,  # no FMA contraction: same roundings as torch's eager ops
    )


def _check_rotary_inputs(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """``apply_rotary``'s input checks with their messages (``ValueError``)."""
    if query.dim() != 3:
        raise ValueError(f"query shape {tuple(query.shape)} != [num_tokens, num_heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    if key.dim() != 3 or key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"key shape {tuple(key.shape)} != [{num_tokens}, num_kv_heads, {head_dim}]"
        )
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions shape {tuple(positions.shape)} != ({num_tokens},)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or head_dim % 2 != 0:
        raise ValueError(
            f"cos_sin_cache shape {tuple(cos_sin_cache.shape)} != [max_positions, {head_dim}] "
            "(head_dim must be even)"
        )
    for name, tensor in {
        "positions": positions,
        "key": key,
        "cos_sin_cache": cos_sin_cache,
    }.items():
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}")
    check_last_dim_contiguous(query=query, key=key, cos_sin_cache=cos_sin_cache)
