"""The CPU backend's paged attention against ``octavo.attention.reference``.

Mixed batches as the scheduler builds them: batched decode rows, fresh prompts, prefill chunks
after a cached prefix, a one-token prompt; grouped-query heads; scattered block tables; and a
cache allocated uninitialised (filled with NaN here) whose unused slots must never reach a
result.
"""

from __future__ import annotations

import random

import pytest
import torch
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import ReferenceAttentionImpl
from octavo_cpu.attention import CPUAttentionBackend

BLOCK_SIZE = 4
HEAD_DIM = 16
NUM_BLOCKS = 64

# (context tokens already cached, new tokens this step) per sequence.
MIXED = [
    (9, 1),   # decode, context ends inside a block
    (0, 7),   # fresh prompt
    (12, 5),  # chunk after a cached prefix that ends on a block boundary
    (3, 1),   # short decode
    (0, 1),   # one-token prompt (takes the decode path)
    (21, 1),  # long decode
    (6, 3),   # chunk after a prefix ending mid-block
]


def _build_step(seqs, num_kv_heads, dtype, seed=0):
    """A NaN-filled cache holding each sequence's cached prefix, plus the step's new tokens."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"),
                          dtype=dtype)
    # Block 0 stays unused (all NaN): it is what block-table padding points at.
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)  # scattered, non-increasing block ids, as after many allocations
    tables, slots, query_start, seq_lens = [], [], [0], []
    for cached, new in seqs:
        seq_len = cached + new
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks)
        for pos in range(seq_len):
            slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            if pos < cached:  # written by earlier steps
                block, offset = divmod(slot, BLOCK_SIZE)
                kv_cache[:, block, offset] = torch.randn(
                    2, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
            else:
                slots.append(slot)
        query_start.append(query_start[-1] + new)
        seq_lens.append(seq_len)
    metadata = AttentionMetadata.from_lists(slots, query_start, seq_lens, tables)
    return kv_cache, metadata, gen


def _run_both(seqs, num_heads, num_kv_heads, dtype):
    kv_cache, metadata, gen = _build_step(seqs, num_kv_heads, dtype)
    num_tokens = metadata.num_tokens
    query = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    cpu_impl = CPUAttentionBackend().make_impl(num_heads, num_kv_heads, HEAD_DIM, scale)
    ref_impl = ReferenceAttentionImpl(num_heads, num_kv_heads, HEAD_DIM, scale)
    cpu_cache, ref_cache = kv_cache.clone(), kv_cache.clone()
    out = cpu_impl.forward(query, key, value, cpu_cache, metadata)
    expected = ref_impl.forward(query, key, value, ref_cache, metadata)
    return out, expected, cpu_cache, ref_cache


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_fp32_matches_reference(num_heads, num_kv_heads):
    out, expected, cpu_cache, ref_cache = _run_both(MIXED, num_heads, num_kv_heads, torch.float32)
    assert out.shape == expected.shape == (sum(n for _, n in MIXED), num_heads, HEAD_DIM)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN from unused cache slots leaked into the output"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Both wrote the new K/V into the same slots (NaN == NaN for the untouched ones).
    torch.testing.assert_close(cpu_cache, ref_cache, equal_nan=True, atol=0, rtol=0)


def test_mixed_batch_bf16_within_tolerance():
    out, expected, _, _ = _run_both(MIXED, 8, 2, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_pure_decode_batch_and_pure_prefill_batch():
    decodes = [(c, 1) for c in (1, 4, 5, 15, 16, 17)]
    out, expected, _, _ = _run_both(decodes, 8, 2, torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    prefills = [(0, 9), (8, 8), (5, 2)]
    out, expected, _, _ = _run_both(prefills, 8, 2, torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_nan_in_padded_table_entries_does_not_leak():
    """Block-table padding (block 0) and the tail of a partial last block hold NaN."""
    seqs = [(1, 1), (30, 1), (2, 3)]  # very different lengths: short rows are padded
    out, expected, cpu_cache, _ = _run_both(seqs, 4, 2, torch.float32)
    assert torch.isnan(cpu_cache).any(), "the test must leave unused slots uninitialised"
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
