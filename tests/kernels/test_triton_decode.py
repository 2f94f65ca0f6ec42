"""``decode_attention`` (flash-decoding) against ``paged_attention_reference``.

``partition_size=16`` splits even the small CPU contexts into several partitions (partition
kernel + reduce kernel); ``partition_size=512`` keeps them in one (single-launch path).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from octavo.attention.reference import paged_attention_reference, write_kv_reference
from octavo.kernels.triton import TritonLaunchConfig, decode_attention

from tests.kernels.conftest import DTYPES, assert_close, make_paged_batch, on_device_of


def run_and_compare(batch, dtype, **launch):
    """Write the new K/V with the reference, run the kernel, compare the real rows."""
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    out = decode_attention(
        batch.query,
        batch.kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len,
        batch.scale,
        **launch,
    )
    with on_device_of(batch.query):
        expected = paged_attention_reference(batch.query, batch.kv_cache, meta, batch.scale)
    n = batch.num_real_tokens
    assert_close(out[:n], expected[:n], dtype)


# name -> context lengths (one decode token per sequence) as functions of the block size
CONTEXT_CASES = {
    "one-token": lambda bs: [1],
    "block-minus-one": lambda bs: [bs - 1],
    "one-block": lambda bs: [bs],
    "block-plus-one": lambda bs: [bs + 1],
    "several-blocks": lambda bs: [4 * bs + 3],
    "batch": lambda bs: [1, bs, 3 * bs + 1, 2 * bs - 1, 5],
}


@pytest.mark.parametrize("case", CONTEXT_CASES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("partition_size", [16, 512])
def test_decode_context_shapes(case, block_size, partition_size):
    seq_lens = CONTEXT_CASES[case](block_size)
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2, head_dim=64,
        block_size=block_size,
    )
    run_and_compare(batch, torch.float32, block_n=16, partition_size=partition_size)


HEAD_LAYOUTS = [(2, 2), (4, 2), (4, 1), (6, 2)]


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_heads_dims_dtypes(heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    seq_lens = [3, 17, 40]
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=8,
        dtype=dtype,
        num_padding_tokens=2,
    )
    run_and_compare(batch, dtype, block_n=16, partition_size=16)


def test_decode_many_partitions():
    # 45 partitions: more than the reduce kernel combines per loop step (32).
    batch = make_paged_batch([1, 1], [720, 30], num_heads=2, num_kv_heads=1, head_dim=64,
                             block_size=16)
    run_and_compare(batch, torch.float32, block_n=16, partition_size=16)


@pytest.mark.parametrize("threshold,expect_split", [(4, False), (100, True)])
def test_decode_wide_batch_is_not_split(threshold, expect_split, monkeypatch):
    # 3 sequences x 2 KV heads = 6 programs; contexts span up to 12 partitions of 16.
    module = importlib.import_module("octavo.kernels.triton.decode_attention")

    launched = []
    reduce_kernel = module._decode_reduce_kernel

    class RecordingKernel:  # records launches of the reduce kernel, then runs it
        def __getitem__(self, grid):
            launched.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(module, "_decode_reduce_kernel", RecordingKernel())
    batch = make_paged_batch([1, 1, 1], [190, 33, 70], num_heads=4, num_kv_heads=2,
                             head_dim=64, block_size=16)
    run_and_compare(batch, torch.float32, block_n=16, partition_size=16,
                    unsplit_min_programs=threshold)
    assert bool(launched) == expect_split


def test_decode_skips_sequences_without_tokens():
    batch = make_paged_batch([1, 0, 1], [9, 12, 20], num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=8)
    run_and_compare(batch, torch.float32, block_n=16, partition_size=16)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_default_launch_config(head_dim):
    config = TritonLaunchConfig()
    batch = make_paged_batch([1, 1], [600, 70], num_heads=8, num_kv_heads=2, head_dim=head_dim,
                             block_size=16)
    run_and_compare(batch, torch.float32, block_n=config.decode_block_n,
                    partition_size=config.decode_partition_size)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (16, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_full_shapes(head_dim, heads, dtype):
    num_heads, num_kv_heads = heads
    seq_lens = [1, 15, 16, 17, 511, 512, 513, 2000, 8191]
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    config = TritonLaunchConfig()
    run_and_compare(batch, dtype, block_n=config.decode_block_n,
                    partition_size=config.decode_partition_size,
                    num_warps=config.decode_num_warps, num_stages=config.decode_num_stages)
