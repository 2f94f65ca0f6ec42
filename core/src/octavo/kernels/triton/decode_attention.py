"""Decode attention over the paged cache (one new token per sequence), flash-decoding style.

A decode step has few query rows but long contexts, so one program per (sequence, KV head)
would leave most of the GPU idle. The context is split into partitions of ``partition_size``
tokens instead:

1. ``_decode_partition_kernel``, one program per (sequence, KV head, partition): attends the
   ``group`` query heads of the KV head (rows padded to >= 16 for ``tl.dot``) over the
   partition's keys with an online softmax, and stores the partition's running max ``m``, sum
   ``l`` and unnormalized output ``acc`` (float32, base-2 scores).
2. ``_decode_reduce_kernel``, one program per (sequence, query head): rescales every
   partition by ``exp2(m_p - max_p m_p)`` and returns ``sum acc_p / sum l_p`` (in one pass
   with a running max).

A launch has ``num_partitions`` partitions per sequence, fixed by the shapes (so it holds
inside a captured graph); each sequence's context is cut into that many equal spans rounded
up to ``block_n`` keys, computed in the kernels from its own length. So a short context under a
graph captured for ``max_model_len`` still spreads over several programs instead of leaving
one program per KV head to walk it key block by key block (latency-bound: at batch 1 that
was 15 µs per layer for 300 keys on an H100). ``num_partitions`` is the larger of what keeps
every span within ``partition_size`` keys and what brings a small batch to about
``unsplit_min_programs`` programs (at most one partition per ``block_n`` keys).

When that is one partition, step 1 normalizes and writes the output itself and step 2 is
skipped. So does a batch wide enough to fill the GPU on its own
(``num_seqs * num_kv_heads >= unsplit_min_programs``): splitting it would only add programs
and the reduce pass, since the bytes of K/V read are the same either way. The token's own K/V
must already be in the cache (``write_kv_cache``). With a sliding window ``W`` only positions
``>= seq_len - W`` are read: partitions wholly before them exit at once and the reduce kernel
starts after them. With a logit soft cap ``c`` every score is ``c * tanh(score / c)``. An fp8
cache's keys are upcast to the query's dtype (exact) and ``k_scale`` is folded into the
softmax scale (before the soft cap); ``v_scale`` multiplies the normalized output. Reference:
``octavo.attention.reference.paged_attention_reference``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import (
    check_attention_inputs,
    dot_fp32,
    is_fp8_cache,
    paged_token_offsets,
    scaled_scores,
    upcast_dot,
)
from octavo.kernels.triton.pdl import pdl_begin, pdl_launch

# Start value of the running max (finite, so padded rows stay NaN-free).
NEG_LARGE = tl.constexpr(-1.0e30)
# Partitions combined per step of the reduce kernel's loop.
_REDUCE_BLOCK = 32
# Most partitions per sequence when a wide batch is split into spans: the partials' buffers
# ([num_seqs, num_heads, partitions, head_dim] float32, per layer) stay bounded for long
# max_model_len (a graph's bound); a context longer than this many spans gets longer spans.
_WIDE_MAX_PARTITIONS = 32


@triton.jit
def _partition_span(seq_len, num_partitions, min_span, BLOCK_N: tl.constexpr):
    """Keys per partition of a ``seq_len``-key context cut into ``num_partitions`` spans: a
    multiple of ``BLOCK_N``, at least ``min_span`` (itself a multiple of ``BLOCK_N``), so spans
    start on key-block boundaries."""
    span = tl.cdiv(tl.cdiv(seq_len, num_partitions), BLOCK_N) * BLOCK_N
    return tl.maximum(span, min_span)


@triton.jit
def _decode_partition_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim] (written when SINGLE_PARTITION)
    part_acc_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] float32
    part_max_ptr,  # [num_seqs, num_heads, num_partitions] float32
    part_sum_ptr,  # [num_seqs, num_heads, num_partitions] float32
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,  # softmax scale * k_scale * log2(e)
    sliding_window,  # keys the token sees (itself included); read when SLIDING
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
    stride_part_seq,  # of part_max / part_sum; part_acc strides are these times head_dim
    stride_part_head,
    head_dim,
    num_partitions,  # the grid's third dimension
    min_span,  # fewest keys per partition (a multiple of BLOCK_N)
    GROUP: tl.constexpr,  # query heads per KV head
    ROWS: tl.constexpr,  # power of two >= max(GROUP, 16)
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:  # no token this step
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    span = _partition_span(seq_len, num_partitions, min_span, BLOCK_N)
    part_start = partition * span
    if part_start >= seq_len:  # the reduce kernel only reads partitions < cdiv(seq_len, span)
        return
    part_end = tl.minimum(seq_len, part_start + span)
    kv_start = part_start
    if SLIDING:
        window_start = tl.maximum(seq_len - sliding_window, 0)
        if part_end <= window_start:  # the reduce kernel skips partitions before the window
            return
        kv_start = tl.maximum(part_start, window_start)

    rows = tl.arange(0, ROWS)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows  # [ROWS] query heads of this KV head
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < head_dim
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_offsets = token.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # [ROWS, D]

    m_i = tl.full([ROWS], NEG_LARGE, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PADDED], tl.float32)

    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    v_base = k_base + stride_cache_kv
    for start in range(kv_start, part_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        pos_valid = positions < part_end
        token_offsets = paged_token_offsets(
            block_table, positions, pos_valid, stride_cache_block, stride_cache_slot,
            CACHE_BLOCK_SIZE,
        )
        kv_offsets = token_offsets[:, None] + dims[None, :]  # [BLOCK_N, D]
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_base + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, D]
        v = tl.load(v_base + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, D]

        dots = dot_fp32(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)  # [ROWS, N]
        scores = scaled_scores(dots, scale_log2, soft_cap, SOFT_CAP)
        scores = tl.where(pos_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])  # [ROWS, N]
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_fp32(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
        m_i = m_new

    if SINGLE_PARTITION:
        out = acc / l_i[:, None] * v_scale  # every valid row saw >= 1 key: l_i > 0 there
        o_offsets = (
            token.to(tl.int64) * stride_o_token + heads[:, None] * stride_o_head + dims[None, :]
        )
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # [ROWS] index of (seq, head, partition) in part_max / part_sum
        stat_index = seq.to(tl.int64) * stride_part_seq + heads * stride_part_head + partition
        tl.store(part_max_ptr + stat_index, m_i, mask=row_valid)
        tl.store(part_sum_ptr + stat_index, l_i, mask=row_valid)
        acc_offsets = stat_index[:, None] * head_dim + dims[None, :]
        tl.store(part_acc_ptr + acc_offsets, acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] float32
    part_max_ptr,  # [num_seqs, num_heads, num_partitions] float32
    part_sum_ptr,  # [num_seqs, num_heads, num_partitions] float32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sliding_window,  # read when SLIDING
    v_scale,  # multiplies the output (fp8 caches; 1 otherwise)
    stride_o_token,
    stride_o_head,
    stride_part_seq,
    stride_part_head,
    head_dim,
    num_partitions,  # as the partition kernel's
    min_span,  # as the partition kernel's
    BLOCK_N: tl.constexpr,  # as the partition kernel's
    BLOCK_P: tl.constexpr,  # partitions per loop step
    HEAD_DIM_PADDED: tl.constexpr,
    SLIDING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    span = _partition_span(seq_len, num_partitions, min_span, BLOCK_N)
    num_parts = tl.cdiv(seq_len, span)  # partitions written: [first_part, num_parts)
    first_part = 0
    if SLIDING:
        first_part = tl.maximum(seq_len - sliding_window, 0) // span
    base = seq.to(tl.int64) * stride_part_seq + head * stride_part_head
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < head_dim

    # One pass with a running max (as the online softmax): each step loads BLOCK_P
    # partitions' max, sum and output together, so a context of up to BLOCK_P partitions
    # costs one round of loads instead of a max pass and then a sum pass.
    run_max = tl.full([1], NEG_LARGE, tl.float32)
    run_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM_PADDED], tl.float32)
    for p0 in range(first_part, num_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        part_valid = parts < num_parts
        m_p = tl.load(part_max_ptr + base + parts, mask=part_valid, other=NEG_LARGE)
        l_p = tl.load(part_sum_ptr + base + parts, mask=part_valid, other=0.0)
        acc_offsets = (base + parts)[:, None] * head_dim + dims[None, :]
        acc_mask = part_valid[:, None] & dim_valid[None, :]
        acc_p = tl.load(part_acc_ptr + acc_offsets, mask=acc_mask, other=0.0)  # [BLOCK_P, D]
        new_max = tl.maximum(run_max, tl.max(m_p, axis=0))  # [1]
        rescale = tl.exp2(run_max - new_max)  # [1]: 1 while the max holds
        weight = tl.where(part_valid, tl.exp2(m_p - new_max), 0.0)  # [BLOCK_P]
        run_sum = run_sum * rescale + tl.sum(weight * l_p, axis=0)
        acc = acc * rescale + tl.sum(acc_p * weight[:, None], axis=0)
        run_max = new_max

    out = acc / tl.sum(run_sum, axis=0) * v_scale  # [D] (v_scale 1: exact)
    o_offsets = token.to(tl.int64) * stride_o_token + head * stride_o_head + dims
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def decode_partitions(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                      partition_size: int, unsplit_min_programs: int | None,
                      wide_batch_span: int | None = None,
                      fill_programs: int | None = None) -> int:
    """Partitions per sequence of a decode launch (see ``decode_split``). Shapes only."""
    return decode_split(num_seqs, num_kv_heads, max_seq_len, block_n, partition_size,
                        unsplit_min_programs, wide_batch_span, fill_programs)[0]


def decode_split(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                 partition_size: int, unsplit_min_programs: int | None,
                 wide_batch_span: int | None = None,
                 fill_programs: int | None = None) -> tuple[int, int]:
    """``(num_partitions, min_span)`` of a decode launch, from the shapes only (so fixed
    inside a captured graph): the partitions per sequence and the fewest keys one covers.

    With ``p = num_seqs * num_kv_heads`` (sequence, KV head) programs:

    - ``p >= unsplit_min_programs`` (a wide batch): not split (``(1, block_n)``), unless
      ``wide_batch_span`` is set and ``p < fill_programs`` (when given): then each sequence
      is cut into spans of ``wide_batch_span`` keys, enough partitions to cover
      ``max_seq_len`` but at most 32 (a longer context gets longer spans; partitions past a
      sequence's length exit at once) — more programs in flight
      for the same bytes, where one program per (sequence, KV head) leaves the GPU's memory
      system idle (measured: ~460 programs of a 0.5B model's W1 step);
    - otherwise: enough partitions to keep spans within ``partition_size`` keys and, for a
      small batch, to reach about ``unsplit_min_programs`` programs, without a span under
      ``block_n`` keys.
    """
    programs = num_seqs * num_kv_heads
    if unsplit_min_programs is not None and programs >= unsplit_min_programs:
        if wide_batch_span is None or (fill_programs is not None and programs >= fill_programs):
            return 1, block_n
        return min(triton.cdiv(max_seq_len, wide_batch_span), _WIDE_MAX_PARTITIONS), \
            wide_batch_span
    by_length = triton.cdiv(max_seq_len, partition_size)
    if unsplit_min_programs is None:
        return by_length, block_n
    to_fill = min(triton.cdiv(unsplit_min_programs, programs), triton.cdiv(max_seq_len, block_n))
    return max(by_length, to_fill), block_n


def decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including the new token
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32; query lengths 1 (or 0 = skipped)
    max_seq_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    block_n: int = 64,
    partition_size: int = 512,
    unsplit_min_programs: int | None = None,
    wide_batch_span: int | None = None,
    fill_programs: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    fp32_dot_precision: str = "ieee",
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's single new token over its whole cached context (its last
    ``sliding_window`` positions when set; scores soft-capped at ``logits_soft_cap``).

    Every sequence must have query length 1 (or 0: skipped, its ``out`` rows untouched);
    ``max_seq_len`` must be >= every ``seq_lens`` entry (it sizes the partition grid).
    ``partition_size`` (a multiple of ``block_n``) bounds the keys per first-kernel program.
    With ``unsplit_min_programs`` set, a batch of at least that many (sequence, KV head)
    programs is not split at all (one program per sequence and KV head, no reduce kernel),
    and a smaller one is split into enough partitions to make about that many programs
    (``decode_split``). With ``wide_batch_span`` (a multiple of ``block_n``) such a wide batch
    of fewer than ``fill_programs`` programs is split after all, into spans of that many keys
    per sequence (plus the reduce kernel). The partition count depends only on
    the shapes and ``max_seq_len``, so it is fixed inside a captured graph; each sequence's
    span follows its own length.
    ``k_scale``/``v_scale`` are an fp8 cache's per-tensor scales (1 for other caches).
    """
    check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc)
    if not is_fp8_cache(kv_cache):
        k_scale = v_scale = 1.0
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_seq_len == 0:
        return out
    if wide_batch_span is not None and (wide_batch_span < block_n or wide_batch_span % block_n):
        raise ValueError(f"wide_batch_span ({wide_batch_span}) must be a positive multiple of "
                         f"block_n ({block_n})")
    num_partitions, min_span = decode_split(num_seqs, num_kv_heads, max_seq_len, block_n,
                                            partition_size, unsplit_min_programs,
                                            wide_batch_span, fill_programs)
    single = num_partitions == 1
    if single:  # the statistics buffers are never touched; pass small placeholders
        part_acc = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=query.device)
        stride_part_seq = stride_part_head = 0
    else:
        part_max = torch.empty(
            (num_seqs, num_heads, num_partitions), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (num_seqs, num_heads, num_partitions, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        stride_part_seq, stride_part_head = part_max.stride(0), part_max.stride(1)
    head_dim_padded = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        kv_cache,
        out,
        part_acc,
        part_max,
        part_sum,
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
        stride_part_seq,
        stride_part_head,
        head_dim,
        num_partitions,
        min_span,
        GROUP=group,
        ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_N=block_n,
        CACHE_BLOCK_SIZE=kv_cache.shape[2],
        SINGLE_PARTITION=single,
        UPCAST_DOT=upcast_dot(query.dtype),
        DOT_PRECISION=fp32_dot_precision,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        **pdl_launch(query.device),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if single:
        return out
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out,
        part_acc,
        part_max,
        part_sum,
        seq_lens,
        query_start_loc,
        sliding_window or 0,
        v_scale,
        *out.stride()[:2],
        stride_part_seq,
        stride_part_head,
        head_dim,
        num_partitions,
        min_span,
        BLOCK_N=block_n,
        BLOCK_P=min(_REDUCE_BLOCK, triton.next_power_of_2(num_partitions)),
        HEAD_DIM_PADDED=head_dim_padded,
        SLIDING=sliding_window is not None,
        **pdl_launch(query.device),
        num_warps=num_warps,
    )
    return out
