"""Prefill / extend attention over the paged cache: many new tokens per sequence, causal.

Each sequence adds ``query_len`` tokens after ``context_len = seq_len - query_len`` tokens
already cached; new token ``i`` sees cache positions ``< context_len + i + 1``. The new tokens'
K/V must already be in the cache (``write_kv_cache``), so the kernel reads every key from the
cache alone, whether it is from a cached prefix, an earlier chunk or this step. With a
sliding window ``W`` token ``i`` sees only positions ``> context_len + i - W``, and a tile
starts its key loop at the first position its first token sees (earlier blocks are never
read); with a logit soft cap ``c`` every score is ``c * tanh(score / c)`` before masking.

Work split: one program per (sequence, KV head, tile of ``tokens_per_tile`` query tokens). A
tile's rows are its tokens times the ``group = num_heads // num_kv_heads`` query heads that share
the KV head (row ``r`` = token ``r // group_padded``, head ``r % group_padded``), so each K/V
tile is loaded once for the whole group (GQA/MQA) and ``tl.dot`` sees at least 16 rows. The
program streams keys ``[0, last visible position]`` in ``block_n`` steps, gathering each key's
cache slot through the block table, with an online (streaming) softmax in float32. Head dims
that are not powers of two (80, 96) are padded to the next power of two with masked loads.

Reference: ``octavo.attention.reference.paged_attention_reference``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import (
    cdiv,
    check_attention_inputs,
    dot_fp32,
    is_fp8_cache,
    next_power_of_2,
    paged_token_offsets,
    scaled_scores,
    upcast_dot,
)

# Start value of the running max: finite, so rows that see no key (padding rows) give
# exp2(-inf - NEG_LARGE) = 0 instead of NaN.
NEG_LARGE = tl.constexpr(-1.0e30)


# Triton compiles a variant per specialization of the arguments (an int equal to 1 or divisible
# by 16, a pointer 16-byte aligned). The per-step arguments below change with the batch (the
# block table's width; the metadata vectors are slices of one copy, at offsets that follow the
# number of sequences), so each new combination compiled a new variant mid-serving (~0.6 s on
# an H100 each, two in W1's first steps). They are read once per program, where the
# specialization buys nothing: one variant serves every step, the one start-up's profile run
# compiles.
@triton.jit(
    do_not_specialize=["stride_bt_seq"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,  # softmax scale * k_scale * log2(e): scores are kept in base 2
    sliding_window,  # keys a token sees (itself included); read when SLIDING
    soft_cap,  # logit soft cap; read when SOFT_CAP
    v_scale,  # multiplies the output (fp8 caches; 1 otherwise)
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PADDED: tl.constexpr,  # next power of two >= GROUP
    TOKENS_PER_TILE: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per loop step
    CACHE_BLOCK_SIZE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_start = tl.program_id(2) * TOKENS_PER_TILE  # first query token of this tile
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    ROWS: tl.constexpr = TOKENS_PER_TILE * GROUP_PADDED
    rows = tl.arange(0, ROWS)
    row_token = tile_start + rows // GROUP_PADDED  # [ROWS] query token index within the seq
    row_head = kv_head * GROUP + rows % GROUP_PADDED  # [ROWS] query head
    row_valid = (row_token < query_len) & (rows % GROUP_PADDED < GROUP)
    row_pos = context_len + row_token  # [ROWS] position of the row's token in the sequence
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < head_dim

    q_offsets = (
        (q_start + row_token).to(tl.int64)[:, None] * stride_q_token
        + row_head[:, None] * stride_q_head
        + dims[None, :]
    )
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # [ROWS, D]

    m_i = tl.full([ROWS], NEG_LARGE, tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([ROWS], tl.float32)  # running softmax denominator
    acc = tl.zeros([ROWS, HEAD_DIM_PADDED], tl.float32)  # running unnormalized output

    # Keys past the tile's last token are invisible to every row of the tile.
    kv_end = tl.minimum(seq_len, context_len + tile_start + TOKENS_PER_TILE)
    # Keys before the window of the tile's first token are invisible to every row of it.
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(context_len + tile_start - sliding_window + 1, 0)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    v_base = k_base + stride_cache_kv
    for start in range(kv_start, kv_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_valid = positions < kv_end
        token_offsets = paged_token_offsets(
            block_table, positions, pos_valid, stride_cache_block, stride_cache_slot,
            CACHE_BLOCK_SIZE,
        )
        kv_offsets = token_offsets[:, None] + dims[None, :]  # [BLOCK_N, D]
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        # [BLOCK_N, D], in the query dtype (a no-op unless the cache stores another dtype)
        k = tl.load(k_base + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_base + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)

        dots = dot_fp32(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)  # [ROWS, N]
        scores = scaled_scores(dots, scale_log2, soft_cap, SOFT_CAP)
        visible = (positions[None, :] <= row_pos[:, None]) & pos_valid[None, :]
        if SLIDING:
            visible = visible & (positions[None, :] > row_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [ROWS]
        p = tl.exp2(scores - m_new[:, None])  # [ROWS, N]
        alpha = tl.exp2(m_i - m_new)  # [ROWS] rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_fp32(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # [ROWS, D]
    o_offsets = (
        (q_start + row_token).to(tl.int64)[:, None] * stride_o_token
        + row_head[:, None] * stride_o_head
        + dims[None, :]
    )
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    fp32_dot_precision: str = "ieee",
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context (the last
    ``sliding_window`` positions of it when set; scores soft-capped at ``logits_soft_cap``).

    Any query lengths (including 1 and 0) may be mixed in one call; tokens outside every
    ``query_start_loc`` range are left unwritten in ``out``. ``block_m`` is the number of tile
    rows (query tokens x padded group, at least 16), ``block_n`` the keys per loop step (halved
    for head dims above 128); both powers of two. ``fp32_dot_precision`` is ``tl.dot``'s
    ``input_precision`` for float32 inputs ("ieee": exact and portable; "tf32": faster on
    NVIDIA). An fp8 cache's keys and values are upcast to the query's dtype (exact);
    ``k_scale`` is folded into the softmax scale and ``v_scale`` multiplies the output.
    """
    check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc)
    if not is_fp8_cache(kv_cache):
        k_scale = v_scale = 1.0
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_padded = next_power_of_2(group)
    tokens_per_tile = max(1, block_m // group_padded)
    head_dim_padded = next_power_of_2(head_dim)
    if head_dim_padded > 128:
        # K and V tiles of block_n x 256 crowd registers and shared memory: halve the step
        # (measured on H100, bf16, head_dim 256: 224 -> 296 TFLOP/s with 32 keys instead of 64).
        block_n = max(16, block_n // 2)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, tokens_per_tile))
    _prefill_kernel[grid](
        query,
        kv_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * k_scale * math.log2(math.e),
        sliding_window or 0,
        float(logits_soft_cap or 0.0),
        v_scale,
        *query.stride()[:2],
        *out.stride()[:2],
        *kv_cache.stride()[:4],  # [K/V, block, offset, head]
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        GROUP_PADDED=group_padded,
        TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_N=block_n,
        CACHE_BLOCK_SIZE=kv_cache.shape[2],
        UPCAST_DOT=upcast_dot(query.dtype),
        DOT_PRECISION=fp32_dot_precision,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
