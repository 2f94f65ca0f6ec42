"""Int4 weight-only (GPTQ/AWQ) skinny GEMM: ``x @ W^T`` for a few rows, reading each packed
int32 once.

Weights as ``int4_linear`` holds them (``octavo.kernels.int4``): ``qweight`` int32
``[K / 8, N]`` (eight consecutive inputs of one output per word; AWQ is repacked to it at
load) or the same words in 32-output panels (``octavo.kernels.int4.to_panels``: 32 words of a
row contiguous, rows of a panel after each other), ``scales``/``zeros`` ``[G, N]``, and
``g_idx [K]`` for act-order checkpoints;
``W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``. The stored layout is read as is:
rows of words are contiguous along N, so a program's ``[block_k / 8, block_n]`` word tile is
coalesced and each word is loaded once (the tile GEMM ``int4_gemm`` loads it for each of its
eight inputs).

Each program takes ``block_n`` outputs and a range of K, ``block_k`` inputs per step with
``block_k`` dividing the group size, so a step lies inside one group ``g`` and the group's
scale and zero are applied once per output, after the sum:

    sum_k x[k] * W[n, k] = scales[g, n] * (sum_k x[k] * q[k, n] - zeros[g, n] * sum_k x[k])

- one row, natural order: bound by instruction issue, not memory, before (an H100 SM issues
  ~128 thread-instructions per clock against ~13 bytes of bandwidth: ~5 per int4 weight at
  the memory rate; the old loop took ~5.5). Now about 2.4 per weight go to the weights: each
  nibble becomes the float32 ``128 + q`` without a conversion (the word masked once per four
  nibbles, ``w & 0x0F0F0F0F`` and ``(w >> 4) & 0x0F0F0F0F``, then one ``prmt`` per nibble
  puts its byte at bits 16..23 of a float whose top byte is 0x43), and one FFMA sums
  ``x[k] * (128 + q[k, n])``; the offset goes with the zero point once per output and step:

      sum_k x[k] * (q - z) = sum_k x[k] * (128 + q) - (128 + z) * sum_k x[k]

  The products are exact for bfloat16 and float16 ``x`` (8 or 11 significant bits times 8).
  The cancellation costs about 7 of float32's 24 bits (partial sums reach ~143 * sum|x|
  where the terms of the result are |q - z| * |x|): observed ~2^-22 of ``sum_k |x[k] *
  s[k, n]|``, far below bfloat16 and float16 outputs' rounding (the worst-case bound is
  checked in ``tests/kernels/test_triton_skinny_gemm.py``). A step's word rows are loaded as
  slices of one word row per thread (``slice_rows``): ``x`` is loaded (bfloat16 in int32
  pairs) and converted once per row and thread, the scale and zero once per output, step
  and thread. SASS per weight of the K loop: ``benchmarks/gpu/sass_op_counts.py``. With
  ``SkinnyConfig.load_stages`` > 1 the steps after the first are a software-pipelined
  ``tl.range`` loop (later steps' words copied into shared memory while the current one is
  summed; the group's scales and zeros loaded as one row a step);
- 2 to 16 rows: ``tl.dot`` of the rows (a 16-row block) with the nibbles as 16-bit values
  (exact: 0..15);
- act-order (``g_idx`` not the natural order): every input has its own group, so the tile is
  dequantized element by element (scales and zeros gathered per input) before the sum: correct
  but slower; such checkpoints could be permuted at load to contiguous groups (not done).

float32 accumulation; split-K programs add partial sums atomically
(``octavo.kernels.triton.skinny_gemm``).

Reference: ``octavo.kernels.int4.int4_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.int4 import is_panels, word_shape
from octavo.kernels.skinny import m_bucket
from octavo.kernels.triton.cache_write import (
    dot_fp32,
    interpreting,
    store_skinny_output,
    upcast_dot,
)
from octavo.kernels.triton.int4_gemm import word_offsets
from octavo.kernels.triton.pdl import pdl_begin, skinny_pdl_launch
from octavo.kernels.triton.skinny_gemm import (
    SkinnyConfig,
    SkinnyOutput,
    SkinnyTuner,
    choose_split_k,
    k_per_split,
    tune_key,
)

TUNER = SkinnyTuner("int4_gemv")


@triton.jit
def _byte_128(masked, byte: tl.constexpr):
    """Byte ``byte`` of ``masked`` (a value 0..15) at bits 16..19 under 0x43: ``128 + q``."""
    return ((((masked >> (8 * byte)) & 0xFF) << 16) | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_pair(pair):
    """float32 of the two bfloat16 in an int32 (low half first)."""
    return ((pair << 16).to(tl.float32, bitcast=True),
            (pair & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _load_x8(x_ptr, row, ok, X_BF16_PAIRS: tl.constexpr):
    """``x[8 * row + j]`` for j < 8 as float32 (``[R, 1]`` each): bfloat16 ``x`` in four int32
    loads of two, other dtypes one by one."""
    if X_BF16_PAIRS:
        pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + row * 4
        x0, x1 = _bf16_pair(tl.load(pairs, mask=ok, other=0))
        x2, x3 = _bf16_pair(tl.load(pairs + 1, mask=ok, other=0))
        x4, x5 = _bf16_pair(tl.load(pairs + 2, mask=ok, other=0))
        x6, x7 = _bf16_pair(tl.load(pairs + 3, mask=ok, other=0))
    else:
        first = row * 8
        x0 = tl.load(x_ptr + first, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + first + 1, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + first + 2, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + first + 3, mask=ok, other=0.0).to(tl.float32)
        x4 = tl.load(x_ptr + first + 4, mask=ok, other=0.0).to(tl.float32)
        x5 = tl.load(x_ptr + first + 5, mask=ok, other=0.0).to(tl.float32)
        x6 = tl.load(x_ptr + first + 6, mask=ok, other=0.0).to(tl.float32)
        x7 = tl.load(x_ptr + first + 7, mask=ok, other=0.0).to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _prmt(src, c43, SELECTOR: tl.constexpr):
    """``prmt.b32 d, src, c43, SELECTOR`` (bytes 0..3 of ``src``, 4..7 of ``c43``)."""
    if SELECTOR == 0x4055:
        d = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x4055;", "=r,r,r", [src, c43],
                                      dtype=tl.int32, is_pure=True, pack=1)
    elif SELECTOR == 0x4155:
        d = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x4155;", "=r,r,r", [src, c43],
                                      dtype=tl.int32, is_pure=True, pack=1)
    elif SELECTOR == 0x4255:
        d = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x4255;", "=r,r,r", [src, c43],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        d = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x4355;", "=r,r,r", [src, c43],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return d


@triton.jit
def _nibble_128(lo, hi, j: tl.constexpr, c43, NIBBLE_ASM: tl.constexpr):
    """float32 ``128 + q`` of nibble ``j`` of each word, from the word's masked low (``lo =
    w & 0x0F0F0F0F``) or high (``hi = (w >> 4) & 0x0F0F0F0F``) nibbles.

    ``NIBBLE_ASM``: one ``prmt`` (inline PTX) moves byte ``j // 2`` to byte 2 under byte 3
    0x43 (``c43``'s low byte; selector 0x4k55: byte k of the source into byte 2, byte 4 =
    0x43 into byte 3, byte 5 = 0 into bytes 0 and 1). ``0x43 0q 00 00`` is
    ``128 * (1 + q * 2^16 / 2^23) = 128 + q`` exactly. Otherwise the same bits in plain Triton
    (the interpreter runs no inline assembly)."""
    if j % 2 == 0:
        src = lo
    else:
        src = hi
    if NIBBLE_ASM:
        return _prmt(src, c43 + src * 0, 0x4055 + 0x100 * (j // 2)).to(tl.float32,
                                                                      bitcast=True)
    else:
        return _byte_128(src, j // 2)


@triton.jit
def _x_of_slice(x_ptr, k0, s: tl.constexpr, k_end, offs_r, SLICE_ROWS: tl.constexpr,
                EVEN_K: tl.constexpr, X_BF16_PAIRS: tl.constexpr):
    """The eight inputs of each word row of slice ``s`` of the step at ``k0``."""
    rows = k0 // 8 + s * SLICE_ROWS + offs_r
    row_ok = (rows[:, None] * 8 < k_end) | EVEN_K
    return _load_x8(x_ptr, rows[:, None], row_ok, X_BF16_PAIRS)


@triton.jit
def _slice_words(qweight_ptr, k0, s: tl.constexpr, k_end, offs_r, word_cols, n_mask,
                 row_words, SLICE_ROWS: tl.constexpr, EVEN_K: tl.constexpr):
    """Slice ``s`` of the step at ``k0``: ``[SLICE_ROWS, BLOCK_N]`` words (zeros past
    ``k_end``; word ``(r, n)`` at ``r * row_words + word_cols[n]``, ``word_offsets``)."""
    rows = k0 // 8 + s * SLICE_ROWS + offs_r  # [R] word rows
    if EVEN_K:  # whole steps: the step is in range or not
        row_ok = rows[:, None] * 0 + k0 < k_end
    else:  # K and k_end are multiples of 8
        row_ok = rows[:, None] * 8 < k_end
    # int32 offsets: the launch checks that the weight has fewer than 2^31 words
    return tl.load(qweight_ptr + (rows[:, None] * row_words + word_cols[None, :]),
                   mask=row_ok & n_mask[None, :], other=0)


@triton.jit
def _step_words(qweight_ptr, k0, k_end, offs_r, word_cols, n_mask, row_words,
                SLICE_ROWS: tl.constexpr, SLICES: tl.constexpr, EVEN_K: tl.constexpr):
    """The step's 1, 2 or 4 slices (unused ones repeat the first: no load)."""
    w0 = _slice_words(qweight_ptr, k0, 0, k_end, offs_r, word_cols, n_mask, row_words,
                      SLICE_ROWS, EVEN_K)
    w1 = w0
    w2 = w0
    w3 = w0
    if SLICES > 1:
        w1 = _slice_words(qweight_ptr, k0, 1, k_end, offs_r, word_cols, n_mask, row_words,
                          SLICE_ROWS, EVEN_K)
    if SLICES > 2:
        w2 = _slice_words(qweight_ptr, k0, 2, k_end, offs_r, word_cols, n_mask, row_words,
                          SLICE_ROWS, EVEN_K)
        w3 = _slice_words(qweight_ptr, k0, 3, k_end, offs_r, word_cols, n_mask, row_words,
                          SLICE_ROWS, EVEN_K)
    return w0, w1, w2, w3


@triton.jit
def _one_row_step(x_ptr, scales_ptr, zeros_ptr, c0, c1, c2, c3, k0, k_end, offs_r, offs_n,
                  n_mask, N, c43, BLOCK_K: tl.constexpr, SLICE_ROWS: tl.constexpr,
                  SLICES: tl.constexpr, GROUP_STEPS: tl.constexpr, EVEN_K: tl.constexpr,
                  X_BF16_PAIRS: tl.constexpr, NIBBLE_ASM: tl.constexpr,
                  PIPELINED: tl.constexpr = False):
    """The ``[SLICE_ROWS, BLOCK_N]`` partial sums of the step at ``k0`` from its words
    (``PIPELINED``: a step of the pipelined loop, ``LOAD_STAGES``)."""
    # Nibble-major over the slices: every slice's words are needed from the start, so
    # ptxas issues all of a step's loads together (slice by slice, it sinks each slice's
    # loads to just before its sums).
    lo0 = c0 & 0x0F0F0F0F
    hi0 = (c0 >> 4) & 0x0F0F0F0F
    x0 = _x_of_slice(x_ptr, k0, 0, k_end, offs_r, SLICE_ROWS, EVEN_K, X_BF16_PAIRS)
    xs = ((x0[0] + x0[1]) + (x0[2] + x0[3])) + ((x0[4] + x0[5]) + (x0[6] + x0[7]))
    if SLICES > 1:
        lo1 = c1 & 0x0F0F0F0F
        hi1 = (c1 >> 4) & 0x0F0F0F0F
        x1 = _x_of_slice(x_ptr, k0, 1, k_end, offs_r, SLICE_ROWS, EVEN_K, X_BF16_PAIRS)
        xs += ((x1[0] + x1[1]) + (x1[2] + x1[3])) + ((x1[4] + x1[5]) + (x1[6] + x1[7]))
    if SLICES > 2:
        lo2 = c2 & 0x0F0F0F0F
        hi2 = (c2 >> 4) & 0x0F0F0F0F
        lo3 = c3 & 0x0F0F0F0F
        hi3 = (c3 >> 4) & 0x0F0F0F0F
        x2 = _x_of_slice(x_ptr, k0, 2, k_end, offs_r, SLICE_ROWS, EVEN_K, X_BF16_PAIRS)
        x3 = _x_of_slice(x_ptr, k0, 3, k_end, offs_r, SLICE_ROWS, EVEN_K, X_BF16_PAIRS)
        xs += ((x2[0] + x2[1]) + (x2[2] + x2[3])) + ((x2[4] + x2[5]) + (x2[6] + x2[7]))
        xs += ((x3[0] + x3[1]) + (x3[2] + x3[3])) + ((x3[4] + x3[5]) + (x3[6] + x3[7]))
    qx = tl.zeros((SLICE_ROWS, c0.shape[1]), dtype=tl.float32)  # sum x * (128 + q)
    for j in tl.static_range(8):
        qx += x0[j] * _nibble_128(lo0, hi0, j, c43, NIBBLE_ASM)
        if SLICES > 1:
            qx += x1[j] * _nibble_128(lo1, hi1, j, c43, NIBBLE_ASM)
        if SLICES > 2:
            qx += x2[j] * _nibble_128(lo2, hi2, j, c43, NIBBLE_ASM)
            qx += x3[j] * _nibble_128(lo3, hi3, j, c43, NIBBLE_ASM)
    g = (k0 // BLOCK_K) // GROUP_STEPS
    if PIPELINED:
        # loads that go through shared memory anyway: one row of each, not R copies
        sz = g * N + offs_n
        scale = tl.load(scales_ptr + sz, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        zero = tl.load(zeros_ptr + sz, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        # The group's scales and zeros broadcast over the rows in the load itself (repeats
        # hit L1), to stay in the words' register layout (no shared-memory shuffle).
        sz = g * N + offs_n[None, :] + offs_r[:, None] * 0  # [R, BLOCK_N]
        scale = tl.load(scales_ptr + sz, mask=n_mask[None, :], other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + sz, mask=n_mask[None, :], other=0.0).to(tl.float32)
    return (qx - xs * (zero + 128.0)) * scale


@triton.jit
def _one_row_natural_order(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, N, k_start, k_end,
                           offs_n, n_mask, row_words, word_cols, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SLICE_ROWS: tl.constexpr,
                           GROUP_STEPS: tl.constexpr, EVEN_K: tl.constexpr,
                           X_BF16_PAIRS: tl.constexpr, NIBBLE_ASM: tl.constexpr,
                           LOAD_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """``[BLOCK_N]`` float32 sums of one row over ``k_start .. k_end`` (natural-order groups).

    A step's ``BLOCK_K / 8`` word rows are loaded as 1, 2 or 4 ``[SLICE_ROWS, BLOCK_N]``
    slices (sized so that a thread holds one word row of each). A thread sums its words of
    all slices against ``x`` (``_one_row_step``) before the group's zero and scale are
    applied, once per output and step. The first step's words are loaded before the PDL
    wait (no kernel of the step writes them): their read overlaps the kernel before."""
    SLICES: tl.constexpr = BLOCK_K // (8 * SLICE_ROWS)
    # 0x43 that the compiler cannot see as a constant (k_end >= 0): kept in a register for
    # prmt's second source, so that the selector stays an immediate
    c43 = (k_end >> 31) | 0x43
    offs_r = tl.arange(0, SLICE_ROWS)
    c0, c1, c2, c3 = _step_words(qweight_ptr, k_start, k_end, offs_r, word_cols, n_mask,
                                 row_words, SLICE_ROWS, SLICES, EVEN_K)
    pdl_begin(USE_PDL)
    acc = _one_row_step(x_ptr, scales_ptr, zeros_ptr, c0, c1, c2, c3, k_start, k_end, offs_r,
                        offs_n, n_mask, N, c43, BLOCK_K, SLICE_ROWS, SLICES, GROUP_STEPS,
                        EVEN_K, X_BF16_PAIRS, NIBBLE_ASM)
    # LOAD_STAGES > 1: later steps' words copied ahead through shared memory (a pipelined
    # loop); else each step's words are loaded when it starts
    for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=max(LOAD_STAGES, 1)):
        c0, c1, c2, c3 = _step_words(qweight_ptr, k0, k_end, offs_r, word_cols, n_mask,
                                     row_words, SLICE_ROWS, SLICES, EVEN_K)
        acc += _one_row_step(x_ptr, scales_ptr, zeros_ptr, c0, c1, c2, c3, k0, k_end, offs_r,
                             offs_n, n_mask, N, c43, BLOCK_K, SLICE_ROWS, SLICES, GROUP_STEPS,
                             EVEN_K, X_BF16_PAIRS, NIBBLE_ASM, LOAD_STAGES > 1)
    return tl.sum(acc, axis=0)


@triton.jit
def _int4_gemv_kernel(
    x_ptr,  # [M, K] activations
    qweight_ptr,  # int32 [K / 8, N], or [N / 32, K / 8, 32] (PANELS)
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # int32 [K] (read when HAS_G_IDX)
    out_ptr,  # [M, N] in x's dtype (float32 zeros: a split without a workspace)
    sums_ptr,  # float32 split-K workspace (store_skinny_output)
    arrivals_ptr,  # int32 arrival counts per block of outputs
    M,
    N,
    K,
    k_split,  # inputs per split, a multiple of BLOCK_K
    stride_xm,
    HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1, or 16 for the tl.dot path
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 8
    SPLIT_K: tl.constexpr,
    IN_KERNEL_SUM: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SLICE_ROWS: tl.constexpr,  # one-row natural order: word rows per slice of a step
    GROUP_STEPS: tl.constexpr,  # natural order: steps per group (group_size / BLOCK_K)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no row masks in the one-row path
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no column masks
    X_BF16_PAIRS: tl.constexpr,  # x is bfloat16 and 4-byte aligned: loaded in int32 pairs
    NIBBLE_ASM: tl.constexpr,  # the nibble unpacking in inline PTX (not in the interpreter)
    LOAD_STAGES: tl.constexpr,  # one row, natural order: steps in flight (SkinnyConfig)
    USE_PDL: tl.constexpr,  # one row, natural order: launched with PDL (octavo.kernels.triton.pdl)
    PANELS: tl.constexpr = False,  # qweight in 32-output panels (int4_gemm.word_offsets)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N) | EVEN_N  # all true (no masks) when N % BLOCK_N == 0
    row_words, word_cols = word_offsets(offs_n, N, K, PANELS)
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if BLOCK_M == 1 and not HAS_G_IDX:
        acc = _one_row_natural_order(
            x_ptr, qweight_ptr, scales_ptr, zeros_ptr, N, k_start, k_end, offs_n, n_mask,
            row_words, word_cols, BLOCK_N, BLOCK_K, SLICE_ROWS, GROUP_STEPS, EVEN_K,
            X_BF16_PAIRS, NIBBLE_ASM, LOAD_STAGES, USE_PDL)
    else:
        acc = _by_steps(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, N, k_start, k_end,
                        stride_xm, offs_m, m_mask, offs_n, n_mask, row_words, word_cols,
                        HAS_G_IDX, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_STEPS, UPCAST_DOT)
    store_skinny_output(out_ptr, acc, offs_m, m_mask, offs_n, n_mask, N, BLOCK_M, SPLIT_K,
                        sums_ptr, arrivals_ptr, IN_KERNEL_SUM)


@triton.jit
def _by_steps(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, N, k_start, k_end, stride_xm,
              offs_m, m_mask, offs_n, n_mask, row_words, word_cols, HAS_G_IDX: tl.constexpr,
              BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_STEPS: tl.constexpr,
              UPCAST_DOT: tl.constexpr):
    """The other paths (act-order for one row; ``tl.dot`` for 2 to 16 rows): ``[BLOCK_N]`` or
    ``[BLOCK_M, BLOCK_N]`` float32 sums over ``k_start .. k_end``."""
    offs_w = tl.arange(0, BLOCK_K // 8)  # word rows of a step
    nibble = tl.arange(0, 8)
    shifts = nibble * 4
    if BLOCK_M == 1:
        # Per word row: sums over a word's eight inputs (in one thread) scaled by their group,
        # added across steps; reduced over the rows once at the end.
        acc_rows = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + offs_w  # [W] word rows
        row_mask = rows * 8 < k_end  # K and k_end are multiples of 8
        words = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * row_words
                        + word_cols[None, :],
                        mask=row_mask[:, None] & n_mask[None, :], other=0)  # [W, BLOCK_N]
        # [W, 8, BLOCK_N]: input 8w + j in nibble j (for the tl.dot paths; the one-row paths
        # shift nibble by nibble and leave it unused, so it is not computed there)
        q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        offs_k = k0 + offs_w[:, None] * 8 + nibble[None, :]  # [W, 8]
        k_mask = offs_k < k_end
        if HAS_G_IDX and BLOCK_M == 1:
            # Every input has its own group: gather its scale and zero per nibble, in the
            # words' [W, BLOCK_N] layout (no shared-memory shuffles in the loop).
            x_words = x_ptr + k0 + offs_w[:, None] * 8  # [W, 1]
            x_mask = row_mask[:, None]
            for j in tl.static_range(8):
                xj = tl.load(x_words + j, mask=x_mask, other=0.0).to(tl.float32)  # [W, 1]
                gj = tl.load(g_idx_ptr + k0 + offs_w[:, None] * 8 + j, mask=x_mask, other=0)
                sz = gj.to(tl.int64) * N + offs_n[None, :]  # [W, BLOCK_N]
                sz_mask = x_mask & n_mask[None, :]
                scale = tl.load(scales_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                zero = tl.load(zeros_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                qj = ((words >> (4 * j)) & 0xF).to(tl.float32)
                acc_rows += (qj - zero) * scale * xj
        elif HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)  # [W, 8]
            sz = groups[:, :, None].to(tl.int64) * N + offs_n[None, None, :]
            sz_mask = k_mask[:, :, None] & n_mask[None, None, :]
            scale = tl.load(scales_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - zero) * scale  # [W, 8, BLOCK_N]
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
                        + (k0 + tl.arange(0, BLOCK_K))[None, :],
                        mask=m_mask[:, None] & (k0 + tl.arange(0, BLOCK_K) < k_end)[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w2 = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x.dtype)
            acc += dot_fp32(x, w2, UPCAST_DOT, "ieee")
        else:
            g = (k0 // BLOCK_K) // GROUP_STEPS
            scale = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            offs_kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_kk[None, :],
                        mask=m_mask[:, None] & (offs_kk < k_end)[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            if UPCAST_DOT:  # the interpreter casts int32 -> bfloat16 wrongly
                q2 = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
            else:
                q2 = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(x.dtype)
            qx = dot_fp32(x, q2, UPCAST_DOT, "ieee")  # [BLOCK_M, BLOCK_N]
            xs = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
            acc += (qx - xs[:, None] * zero[None, :]) * scale[None, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc_rows, axis=0)
    return acc


def default_config(n: int, k: int, m: int) -> SkinnyConfig:
    """The untuned launch: 128 outputs x 128 inputs (one group of 128: 8 KiB of words) per
    step for one row; 64 x 128 for the ``tl.dot`` path."""
    return SkinnyConfig(block_n=128 if m == 1 else 64, block_k=128)


# One-row configs with software-pipelined K loops (``SkinnyConfig.load_stages``; on the H100
# they won at gate_up only: docs/benchmarks.md, "Pipelined one-row loops").
PIPELINED_CONFIGS = [SkinnyConfig(64, 128, load_stages=4), SkinnyConfig(128, 128, load_stages=3),
                     SkinnyConfig(128, 128, load_stages=4), SkinnyConfig(256, 128, load_stages=3),
                     SkinnyConfig(512, 128, num_warps=8, load_stages=3),
                     SkinnyConfig(128, 128, split_k=4, load_stages=4),
                     SkinnyConfig(64, 128, split_k=4, load_stages=4)]


def candidate_configs(m: int) -> list[SkinnyConfig]:
    """What the tuner times for rows bucket ``m`` (``block_k`` is cut to the group size)."""
    if m == 1:
        # split_k=16: short K chains and ~6 or more programs per SM, for more bytes in flight
        # than choose_split_k's two programs per SM give (the one-row loop now needs few
        # registers)
        return [SkinnyConfig(64, 128), SkinnyConfig(128, 128, num_warps=8),
                SkinnyConfig(256, 128), SkinnyConfig(512, 128, num_warps=8),
                SkinnyConfig(128, 128, split_k=16), SkinnyConfig(64, 128, split_k=16),
                SkinnyConfig(256, 64, num_warps=8), SkinnyConfig(256, 32),
                SkinnyConfig(512, 32, num_warps=8), SkinnyConfig(32, 128),
                SkinnyConfig(128, 64), *PIPELINED_CONFIGS]
    return [SkinnyConfig(32, 128), SkinnyConfig(128, 128, num_warps=8),
            SkinnyConfig(64, 64), SkinnyConfig(128, 64)]


def fit_block_k(block_k: int, group_size: int, has_g_idx: bool) -> int:
    """``block_k`` cut so that a step stays inside one group: the largest power of two at most
    ``block_k`` dividing ``group_size`` (at least 8: groups are multiples of 8)."""
    if has_g_idx:
        return block_k
    fitted = block_k
    while fitted > 8 and group_size % fitted:
        fitted //= 2
    return fitted


def slice_rows(block_n: int, block_k: int, num_warps: int) -> int:
    """Word rows per slice of a one-row step: ``[rows, block_n]`` words give each thread eight
    words of one row (two 16-byte loads), or the whole step when it is smaller; at least a
    quarter of the step (the kernel takes 1, 2 or 4 slices)."""
    return max(1, block_k // 32, min(block_k // 8, 32 * num_warps * 8 // block_n))


def kernel_constexprs(x: torch.Tensor, n: int, k: int, group_size: int, has_g_idx: bool,
                      config: SkinnyConfig, split: int, use_pdl: bool = False) -> dict:
    """The compile-time arguments of ``_int4_gemv_kernel`` for a launch (also what
    ``benchmarks/gpu/sass_op_counts.py`` and ``tests/kernels/sm90_compile_check.py`` compile)."""
    m = x.shape[0]
    block_k = fit_block_k(config.block_k, group_size, has_g_idx)
    return {
        "HAS_G_IDX": has_g_idx,
        "BLOCK_M": 1 if m == 1 else 16,
        "BLOCK_N": config.block_n,
        "BLOCK_K": block_k,
        "SPLIT_K": split,
        "UPCAST_DOT": upcast_dot(x.dtype),
        "SLICE_ROWS": slice_rows(config.block_n, block_k, config.num_warps),
        "GROUP_STEPS": 1 if has_g_idx else max(1, group_size // block_k),
        "EVEN_K": k % block_k == 0,
        "EVEN_N": n % config.block_n == 0,
        "X_BF16_PAIRS": x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0,
        "NIBBLE_ASM": not interpreting(),
        "LOAD_STAGES": config.load_stages,
        "USE_PDL": use_pdl,
    }


def _launch(x, qweight, scales, zeros, group_size, g_idx, config: SkinnyConfig) -> torch.Tensor:
    m, k = x.shape
    n = word_shape(qweight)[1]
    block_k = fit_block_k(config.block_k, group_size, g_idx is not None)
    split = choose_split_k(n, k, SkinnyConfig(config.block_n, block_k, config.split_k), x.device)
    out = SkinnyOutput.make(m, n, config.block_n, split, x.dtype, x.device)
    # PDL for the one-row natural-order path only (the one that loads before its wait)
    pdl = skinny_pdl_launch(x.device, m if g_idx is None else 0)
    grid = (triton.cdiv(n, config.block_n), split)
    _int4_gemv_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else qweight, out.out, out.sums,
        out.arrivals, m, n, k, k_per_split(k, split, block_k), x.stride(0),
        **kernel_constexprs(x, n, k, group_size, g_idx is not None, config, split,
                            use_pdl=pdl["USE_PDL"]),
        IN_KERNEL_SUM=out.in_kernel_sum, PANELS=is_panels(qweight),
        num_warps=config.num_warps, num_stages=config.num_stages,
        **{name: value for name, value in pdl.items() if name != "USE_PDL"},
    )
    return out.result()


def int4_gemv(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, M <= SMALL_M_MAX
    qweight: torch.Tensor,  # int32 [K / 8, N], or panels [N / 32, K / 8, 32]
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    group_size: int,
    g_idx: torch.Tensor | None = None,  # int32 [K] (act-order), or None
    config: SkinnyConfig | None = None,  # None: tuned (GPU) or default_config
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T`` for 4-bit ``W`` (see the module docstring)."""
    m, k = x.shape
    rows, n = word_shape(qweight)
    if rows * 8 != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(
            f"int4_gemv: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
            f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not describe one [K={k}] x "
            f"[N={n}] weight")
    if g_idx is None and group_size % 8:
        raise ValueError(f"int4_gemv: group_size {group_size} is not a multiple of 8")
    if qweight.numel() >= 2**31:
        raise ValueError(f"int4_gemv: qweight {tuple(qweight.shape)} has 2^31 words or more; "
                         "split the layer (the one-row path indexes words in int32)")
    x = x.contiguous()
    if config is None:
        bucket = m_bucket(m)
        config = TUNER.choose(
            tune_key(n=n, k=k, m=bucket, dtype=x.dtype, group=group_size,
                     act_order=g_idx is not None), x.device,
            default_config(n, k, bucket), candidate_configs(bucket),
            lambda c: _launch(x, qweight, scales, zeros, group_size, g_idx, c))
    return _launch(x, qweight, scales, zeros, group_size, g_idx, config)
