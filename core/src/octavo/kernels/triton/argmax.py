"""Greedy argmax over the logits of a few rows, in two short kernels.

At batch 1 torch's ``argmax`` over one row of a Llama-3 vocabulary (128,256 logits) took
27.5 µs of GPU time a decode step on an H100 (docs/benchmarks.md): a few thread blocks walk
the whole row, and the step's next graph waits for the token. Here the row is cut into
chunks of ``BLOCK`` logits, one program each, that keep their largest value and its first
index; a second kernel, one program per row, takes the first chunk holding the row's
largest value.

Same answer as ``torch.argmax(logits, dim=-1)``: the first index of the largest value of
each row (ties: the lowest index; a row of ``-inf``: 0). A row holding NaN gets the index of
one of its NaNs (torch: its first NaN): NaN logits mean a broken model, either way.

Grid: ``(num_rows, num_chunks)``, then ``(num_rows,)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.kernels.triton.pdl import pdl_begin, pdl_launch

# Logits one program of the first kernel reads (16 KiB of bfloat16).
BLOCK = 8192


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,  # [num_rows, vocab] (row stride stride_row)
    chunk_max_ptr,  # [num_rows, num_chunks] float32
    chunk_index_ptr,  # [num_rows, num_chunks] int64
    stride_row,
    vocab,
    num_chunks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: above every number
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, best)
    tl.store(chunk_index_ptr + row * num_chunks + chunk, (chunk * BLOCK + at).to(tl.int64))


@triton.jit
def _row_argmax_kernel(
    chunk_max_ptr,  # [num_rows, num_chunks] float32
    chunk_index_ptr,  # [num_rows, num_chunks] int64
    tokens_ptr,  # [num_rows] int64
    num_chunks,
    CHUNKS: tl.constexpr,  # power of two >= num_chunks
    USE_PDL: tl.constexpr,
):
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    best = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                   other=float("-inf"))
    _, first = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(tokens_ptr + row, tl.load(chunk_index_ptr + row * num_chunks + first))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows]
    """``torch.argmax(logits, dim=-1)`` (int64) for a 2-D ``logits`` whose last dimension is
    contiguous (module docstring)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows: logits of shape {tuple(logits.shape)} and strides "
                         f"{logits.stride()} are not rows with contiguous logits")
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if vocab == 0:
        raise ValueError("argmax_rows: rows of no logits have no argmax")
    num_chunks = triton.cdiv(vocab, BLOCK)
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_index = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    pdl = pdl_launch(logits.device)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        logits, chunk_max, chunk_index, logits.stride(0), vocab, num_chunks, BLOCK=BLOCK,
        num_warps=8, **pdl)
    _row_argmax_kernel[(num_rows,)](
        chunk_max, chunk_index, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=1, **pdl)
    return out
