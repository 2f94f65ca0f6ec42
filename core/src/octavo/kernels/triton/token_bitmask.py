"""A step's grammar bitmask applied to the logits in one kernel: every token a row's mask does
not allow set to ``-inf``, in place.

The torch ops it replaces on CUDA (``octavo.sample.sampler.mask_by_bitmask``) unpack the
``[k, words]`` int32 mask into a ``[k, 4 * words, 8]`` byte tensor, compare it into a bool
tensor and fill through it: four to six launches from the engine thread on the chain from a
constrained step's masks to its sampling, and three passes over intermediates as large as
the logits. Here each program reads the words of ``BLOCK`` tokens of one row and stores
``-inf`` at the refused ones; the logits are never read.

Bit ``t % 32`` of word ``t // 32`` (little-endian) allows token ``t``; tokens past the mask's
``32 * words`` are refused (the torch reference's padding). With ``row_ids`` mask row ``i``
applies to logits row ``row_ids[i]`` (the constrained rows among a batch's), else to row ``i``.

Grid: ``(k, cdiv(vocab, BLOCK))``. Reference: ``octavo.sample.sampler.mask_by_bitmask_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.cache_write import cdiv

#: Tokens one program covers (128 words of the mask).
BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [rows, vocab] (row stride stride_logits)
    bitmask_ptr,  # [k, words] int32 (row stride stride_mask)
    row_ids_ptr,  # [k] int64, or unused
    stride_logits,
    stride_mask,
    vocab,
    num_words,
    HAS_ROW_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_mask + tokens // 32,
                    mask=in_vocab & (tokens // 32 < num_words), other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    if HAS_ROW_IDS:
        row = tl.load(row_ids_ptr + i)
    else:
        row = i.to(tl.int64)
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, minus_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, row_ids: torch.Tensor | None,
                        bitmask: torch.Tensor) -> None:
    """Set the tokens of ``logits`` [rows, vocab] (float, unit stride along the vocabulary)
    rows ``row_ids`` [k] (every row, in order, when None) that ``bitmask`` [k, words] int32
    does not allow to ``-inf``, in place (module docstring). Every tensor on one device."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a [rows, vocab] float tensor with unit stride along "
                         f"the vocabulary, got {tuple(logits.shape)} {logits.dtype} with "
                         f"strides {logits.stride()}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [k, words] int32, got {tuple(bitmask.shape)} "
                         f"{bitmask.dtype}")
    k, num_words = bitmask.shape
    if row_ids is None:
        if k != logits.shape[0]:
            raise ValueError(f"a bitmask of {k} rows for logits of {logits.shape[0]} rows "
                             "needs row_ids")
        row_ids_arg = bitmask  # unused (HAS_ROW_IDS is off)
    else:
        if row_ids.shape != (k,):
            raise ValueError(f"row_ids must be [{k}], got {tuple(row_ids.shape)}")
        row_ids_arg = row_ids.to(torch.int64)
    if k == 0:
        return
    bitmask = bitmask.contiguous() if bitmask.stride(1) != 1 else bitmask
    vocab = logits.shape[1]
    _apply_token_bitmask_kernel[(k, cdiv(vocab, BLOCK))](
        logits, bitmask, row_ids_arg, logits.stride(0), bitmask.stride(0), vocab, num_words,
        HAS_ROW_IDS=row_ids is not None, BLOCK=BLOCK)
