"""``prefill_attention`` against ``paged_attention_reference``.

The CPU (interpreter) cases use small tiles (``block_m = block_n = 16``) so that a few dozen
tokens already span several query tiles and key steps; the ``gpu`` cases use the default
launch parameters and full shapes.
"""

from __future__ import annotations

import pytest
import torch

from octavo.attention.reference import paged_attention_reference, write_kv_reference
from octavo.kernels.triton import TritonLaunchConfig, prefill_attention
from tests.kernels.conftest import DTYPES, assert_close, make_paged_batch, on_device_of

SMALL_TILES = dict(block_m=16, block_n=16)

# name -> (query_lens, seq_lens) as functions of the cache block size
SEQUENCE_CASES = {
    "one-token": lambda bs: ([1], [1]),
    "block-minus-one": lambda bs: ([bs - 1], [bs - 1]),
    "one-block": lambda bs: ([bs], [bs]),
    "block-plus-one": lambda bs: ([bs + 1], [bs + 1]),
    "several-blocks": lambda bs: ([3 * bs + 5], [3 * bs + 5]),
    "chunk-after-prefix": lambda bs: ([7], [2 * bs + 3]),
    "mixed": lambda bs: ([5, 1, bs + 1, 0, 2], [5, 3 * bs, 2 * bs + 1, bs, bs]),
}


def run_and_compare(batch, dtype, **launch):
    """Write the new K/V with the reference, run the kernel, compare the real rows."""
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    out = prefill_attention(
        batch.query,
        batch.kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        batch.scale,
        **launch,
    )
    with on_device_of(batch.query):
        expected = paged_attention_reference(batch.query, batch.kv_cache, meta, batch.scale)
    n = batch.num_real_tokens
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert_close(out[:n], expected[:n], dtype)


@pytest.mark.parametrize("case", SEQUENCE_CASES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_sequence_shapes(case, block_size):
    query_lens, seq_lens = SEQUENCE_CASES[case](block_size)
    batch = make_paged_batch(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size
    )
    run_and_compare(batch, torch.float32, **SMALL_TILES)


# (num_heads, num_kv_heads): multi-head, GQA 2, MQA 4, and a group of 3 (padded to 4).
HEAD_LAYOUTS = [(2, 2), (4, 2), (4, 1), (6, 2)]


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_heads_dims_dtypes(heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    query_lens, seq_lens = SEQUENCE_CASES["mixed"](8)
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=8,
        dtype=dtype,
        num_padding_tokens=1,
    )
    run_and_compare(batch, dtype, **SMALL_TILES)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_prefill_default_launch_config(head_dim):
    # 256 also covers the halved key step for head dims above 128.
    config = TritonLaunchConfig()
    batch = make_paged_batch(
        [40, 3], [70, 3], num_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=16
    )
    run_and_compare(batch, torch.float32, block_m=config.prefill_block_m,
                    block_n=config.prefill_block_n)


def test_prefill_group_larger_than_tile():
    # group 32 > block_m 16: one token per tile, 32 rows.
    batch = make_paged_batch([5], [9], num_heads=32, num_kv_heads=1, head_dim=64, block_size=8)
    run_and_compare(batch, torch.float32, **SMALL_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (16, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_full_shapes(head_dim, heads, dtype):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(
        [1000, 513, 1, 17, 256],
        [1000, 2049, 700, 17, 4096],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        num_padding_tokens=7,
    )
    config = TritonLaunchConfig()
    run_and_compare(batch, dtype, block_m=config.prefill_block_m, block_n=config.prefill_block_n,
                    num_warps=config.prefill_num_warps, num_stages=config.prefill_num_stages)


@pytest.mark.gpu
def test_prefill_compiles_one_variant_for_every_batch_shape():
    # The per-step arguments (block table width, metadata slices at offsets that follow the
    # number of sequences) must not select a new Triton variant: a compile mid-serving costs
    # ~0.6 s on an H100. Widths 3, 17 and 64; 1, 2, 3, 4 and 5 sequences.
    from octavo.kernels.triton.prefill_attention import _prefill_kernel

    cases = [([40], [40]), ([5, 1], [260, 3]), ([7, 9, 2], [1000, 9, 50]),
             ([1, 1, 1, 64], [17, 18, 19, 64]), ([3, 1, 4, 1, 5], [3, 1, 4, 1, 5])]
    variants = None
    for query_lens, seq_lens in cases:
        batch = make_paged_batch(query_lens, seq_lens, num_heads=8, num_kv_heads=2,
                                 head_dim=64, block_size=16, dtype=torch.bfloat16)
        lengths = torch.cat([batch.metadata.query_start_loc, batch.metadata.seq_lens])
        num_seqs = len(seq_lens)
        # As the model runner passes them: both vectors are slices of one int32 copy.
        batch.metadata.query_start_loc = lengths[: num_seqs + 1]
        batch.metadata.seq_lens = lengths[num_seqs + 1 :]
        run_and_compare(batch, torch.bfloat16)
        kernels = _prefill_kernel.device_caches[torch.cuda.current_device()][0]
        if variants is None:
            variants = len(kernels)
        assert len(kernels) == variants, f"a new variant compiled for {query_lens}/{seq_lens}"
