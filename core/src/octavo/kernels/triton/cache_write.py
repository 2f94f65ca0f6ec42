"""Writing new K/V into the paged cache, plus the paged-cache helpers the attention kernels share.

Shared helpers: ``paged_token_offsets`` (block table -> cache addresses), ``dot_fp32`` and
``upcast_dot`` (``tl.dot`` with an interpreter workaround), ``scaled_scores`` (softmax scale
and logit soft-capping), ``check_attention_inputs``, and ``store_skinny_output`` (the epilogue
of the small-M quantized GEMMs: kept here beside ``dot_fp32``, since the interpreter failed to
call it from ``skinny_gemm``'s module). Host-side, for the wrappers' launch parameters:
``next_power_of_2`` and ``cdiv`` (plain Python; Triton 3.9's are constexpr functions costing
~1.5 µs a call from host code) and ``KERNELS_INTERPRETED``.

Launch cost: an eager prompt step launches ~150 of these kernels from Python, so the wrappers
keep their per-call work small: checks are one boolean expression on the happy path (the
detailed ``ValueError`` is built only when it fails), nothing reads the environment per call.

Cache layout (``octavo.attention.base``): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``, i.e. at slot ``block_id * block_size + offset``. Every address is computed
from strides, so a cache view with padded strides works too.

An fp8 cache (``--kv-cache-dtype fp8``: ``torch.float8_e4m3fn``) holds ``x / scale`` with one
scale per tensor (``k_scale`` for keys, ``v_scale`` for values, per layer), saturated to
e4m3's +-448; readers multiply by the scale (``octavo.attention.base``).

Reference: ``octavo.attention.reference.write_kv_reference``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from octavo.attention.reference import FP8_E4M3_MAX
from octavo.attention.reference import is_fp8 as is_fp8_cache
from octavo.kernels.triton.pdl import pdl_begin, pdl_launch

# Saturation bound of the fp8 write, for the kernel.
FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``).

    ``TRITON_INTERPRET`` is Triton's own variable (read by ``triton.jit`` when a kernel is
    defined); Octavo only reads it to route around interpreter gaps (see ``upcast_dot``).
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``, as ``triton.cdiv``."""
    return -(-a // b)


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands of ``dtype`` must be cast to float32 first.

    The Triton 3.9 CPU interpreter returns garbage for ``tl.dot`` on bfloat16 operands, so
    under the interpreter bf16 tiles are upcast; compiled kernels always use native dots.
    """
    return KERNELS_INTERPRETED and dtype == torch.bfloat16


def last_dims_contiguous(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's last dimension is contiguous (the cheap test; on ``False`` call
    ``check_last_dim_contiguous`` with names for the error)."""
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            return False
    return True


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor's last dimension is contiguous (the kernels'
    only layout requirement; other strides are passed to them)."""
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} needs a contiguous last dimension, got strides {tuple(tensor.stride())}"
            )


def check_attention_inputs(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
) -> None:
    """Shape checks shared by the prefill and decode wrappers (``ValueError`` on mismatch).

    One boolean expression when the inputs are right (it runs every launch); the messages are
    built by ``_attention_input_error`` only when they are not."""
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != query.shape[2]
            or query.shape[1] % kv_cache.shape[3] != 0 or block_tables.dim() != 2
            or block_tables.shape[0] != seq_lens.shape[0]
            or query_start_loc.dim() != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1
            or query.stride(-1) != 1 or kv_cache.stride(-1) != 1
            or block_tables.stride(-1) != 1):
        _attention_input_error(query, kv_cache, block_tables, seq_lens, query_start_loc)
        raise AssertionError("_attention_input_error passed inputs the fast test refused")


def _attention_input_error(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """``check_attention_inputs``'s checks with their messages (``ValueError``)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match "
            f"[2, num_blocks, block_size, num_kv_heads, {head_dim}]"
        )
    if num_heads % kv_cache.shape[3] != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_cache.shape[3]})"
        )
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables shape {tuple(block_tables.shape)} != [{num_seqs}, *]")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc shape {tuple(query_start_loc.shape)} != ({num_seqs + 1},)"
        )
    check_last_dim_contiguous(query=query, kv_cache=kv_cache, block_tables=block_tables)


@triton.jit
def dot_fp32(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` with a float32 result; see ``upcast_dot`` for ``UPCAST``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def scaled_scores(dots, scale_log2, soft_cap, SOFT_CAP: tl.constexpr):
    """Base-2 softmax scores of raw ``q.k`` dots: ``dots * scale * log2(e)``, or with
    ``SOFT_CAP`` ``cap * tanh(dots * scale / cap) * log2(e)`` (``scale_log2`` is
    ``scale * log2(e)``)."""
    if SOFT_CAP:
        LOG2E: tl.constexpr = 1.4426950408889634
        x = dots * (scale_log2 / LOG2E) / soft_cap
        # tanh from one exp of a non-positive argument: no overflow for any |x|.
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t) * (soft_cap * LOG2E)
    return dots * scale_log2


@triton.jit
def paged_token_offsets(
    block_table_ptr,  # this sequence's row of the block table (int32)
    positions,  # [BLOCK_N] token positions in the sequence
    mask,  # [BLOCK_N] which positions are real (others read block 0)
    stride_cache_block,
    stride_cache_slot,
    CACHE_BLOCK_SIZE: tl.constexpr,
):
    """Element offsets ``[BLOCK_N]`` (int64) of tokens ``positions`` in one K or V cache half."""
    block_ids = tl.load(block_table_ptr + positions // CACHE_BLOCK_SIZE, mask=mask, other=0)
    block_ids = block_ids.to(tl.int64)  # block_id * stride may pass 2**31 in large caches
    return block_ids * stride_cache_block + (positions % CACHE_BLOCK_SIZE) * stride_cache_slot


@triton.jit
def round_to_e4m3(x):
    """``x`` (float32) saturated to +-448 and rounded to the nearest e4m3 value, ties to even
    (as torch's cast), still in float32: the cast to fp8 that follows is then exact.

    Done in arithmetic because the Triton interpreter's fp32 -> fp8 cast truncates the
    mantissa carry (31.2 -> 16). The grid step is 2**(exponent - 3) for normal values and
    2**-9 below 2**-6 (subnormals); adding and subtracting 1.5 * 2**23 rounds to a whole
    number of steps (|x / step| < 16) in IEEE round-to-nearest-even, as torch's cast does.

    Every operation is exact or correctly rounded by construction, so compiled kernels agree
    with torch's cast bit for bit: the division by the step is a multiplication by its inverse,
    built from bits (an exact power of two), because compiled Triton lowers fp32 ``/`` to
    ``div.full.f32`` (up to 2 ulp off), which moved exact ties (frequent: a bf16 input times a
    power-of-two scale lands on them) to the wrong side on the GPU.
    """
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((127 - (exponent - 3)) << 23).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(x) * inverse_step + 12582912.0) - 12582912.0) * step
    # The sign goes back as a bit: compiled, ``-rounded`` is ``0 - rounded``, which turns a
    # negative value rounded to zero into +0 where torch's cast keeps -0.
    sign = bits & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    k_inv_scale,  # 1 / k_scale (fp8 caches only)
    v_inv_scale,  # 1 / v_scale (fp8 caches only)
    CACHE_BLOCK_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,  # next power of two >= num_kv_heads
    HEAD_DIM_PADDED: tl.constexpr,  # next power of two >= head_dim
    QUANTIZE_FP8: tl.constexpr,  # the cache is e4m3: scale and saturate before the cast
    USE_PDL: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` K and V tiles to its slot."""
    pdl_begin(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // CACHE_BLOCK_SIZE
    block_offset = slot % CACHE_BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)  # [heads, dim]

    k_offsets = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    v_offsets = token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    key = tl.load(key_ptr + k_offsets, mask=mask)  # [heads, dim]
    value = tl.load(value_ptr + v_offsets, mask=mask)  # [heads, dim]

    cache_offsets = (
        block_id * stride_cache_block
        + block_offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    if QUANTIZE_FP8:
        key = round_to_e4m3(key.to(tl.float32) * k_inv_scale)
        value = round_to_e4m3(value.to(tl.float32) * v_inv_scale)
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + cache_offsets, key.to(cache_dtype), mask=mask)
    tl.store(cache_ptr + stride_cache_kv + cache_offsets, value.to(cache_dtype), mask=mask)


#: Whether Triton defined this process's kernels for its CPU interpreter: it decides when a
#: kernel is defined (``TRITON_INTERPRET=1`` at import), so this is read once here, not per
#: launch (``interpreting()`` reads the variable itself).
KERNELS_INTERPRETED: bool = isinstance(_write_kv_kernel, InterpretedFunction)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = padding, skipped
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_warps: int = 4,
) -> None:
    """Scatter each token's K/V into cache slot ``slot_mapping[token]``, in place.

    ``key``/``value`` are cast to the cache dtype; into an fp8 cache as ``key / k_scale`` and
    ``value / v_scale`` saturated to +-448 (the scales are ignored for other caches). Slots
    must be unique among non-padding tokens (two tokens writing one slot race). The last
    dimension of every tensor must be contiguous; other strides are free.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if (value.shape != key.shape or kv_cache.dim() != 5 or kv_cache.shape[0] != 2
            or kv_cache.shape[3:] != key.shape[1:] or slot_mapping.shape != (num_tokens,)
            or not last_dims_contiguous(key, value, kv_cache)):
        _check_write_kv_inputs(key, value, kv_cache, slot_mapping)
        raise AssertionError("_check_write_kv_inputs passed inputs the fast test refused")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *kv_cache.stride()[:4],  # [K/V, block, offset, head]
        num_kv_heads,
        head_dim,
        1.0 / k_scale,
        1.0 / v_scale,
        CACHE_BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PADDED=next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        QUANTIZE_FP8=is_fp8_cache(kv_cache),
        **pdl_launch(key.device),
        num_warps=num_warps,
    )


def _check_write_kv_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``write_kv_cache``'s input checks with their messages (``ValueError``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    check_last_dim_contiguous(key=key, value=value, kv_cache=kv_cache)


@triton.jit
def store_skinny_output(out_ptr, acc, offs_m, m_mask, offs_n, n_mask, N,
                        BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                        sums_ptr, arrivals_ptr, IN_KERNEL_SUM: tl.constexpr):
    """The small-M kernels' epilogue: ``acc`` (``[BLOCK_N]`` for one row, else
    ``[BLOCK_M, BLOCK_N]``) into the ``[M, N]`` output.

    - ``SPLIT_K == 1``: stored.
    - split, ``IN_KERNEL_SUM``: added with float32 atomics into ``sums_ptr`` (``[M, N]``,
      zero before the launch); the program of this block of outputs that arrives last at
      ``arrivals_ptr[program_id(0)]`` (an int32 count, zero before) stores the total in
      ``out_ptr``'s dtype and leaves both at zero for the next launch
      (``octavo.kernels.triton.skinny_gemm.SplitKWorkspace``): no zeroing and no cast
      kernel around the launch.
    - split otherwise: added with float32 atomics into ``out_ptr`` itself (zeroed before,
      cast after by the caller).
    """
    if BLOCK_M == 1:
        offsets = offs_n
        mask = n_mask
    else:
        offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif IN_KERNEL_SUM:
        tl.atomic_add(sums_ptr + offsets, acc, mask=mask)
        # Every thread's partial sums issued before the count that publishes them.
        tl.debug_barrier()
        block = tl.program_id(0)
        arrived = tl.atomic_add(arrivals_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # The totals read from L2, where the atomics landed (".cg": not through L1).
            total = tl.load(sums_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
            # Every thread's totals read before any thread zeroes them: the compiler may lay
            # the read and the zeroing (acc's layout) over the threads differently (the PTX
            # of the 16-row tl.dot tiles does: without this barrier 4-row sums came out wrong
            # on an H200 in 8 of 10 runs of the GPU test, with it right in 4 of 4).
            tl.debug_barrier()
            tl.store(sums_ptr + offsets, tl.zeros_like(acc), mask=mask)
            tl.atomic_xchg(arrivals_ptr + block, 0)
    else:
        tl.atomic_add(out_ptr + offsets, acc, mask=mask)
