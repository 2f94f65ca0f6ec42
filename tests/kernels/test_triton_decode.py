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
from octavo.kernels.triton.decode_attention import decode_partitions

from tests.kernels.conftest import DTYPES, assert_close, make_paged_batch, on_device_of


def run_and_compare(batch, dtype, max_seq_len=None, **launch):
    """Write the new K/V with the reference, run the kernel, compare the real rows.

    ``max_seq_len``: the bound passed to the kernel (default: the batch's own longest
    context; CUDA graphs pass ``max_model_len``)."""
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    out = decode_attention(
        batch.query,
        batch.kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_seq_len if max_seq_len is None else max_seq_len,
        batch.scale,
        **launch,
    )
    with on_device_of(batch.query):
        expected = paged_attention_reference(batch.query, batch.kv_cache, meta, batch.scale)
    n = batch.num_real_tokens
    assert_close(out[:n], expected[:n], dtype)


def record_launches(monkeypatch, kernel_name: str) -> list:
    """The grids of ``decode_attention``'s launches of ``kernel_name`` from now on (each still
    runs)."""
    module = importlib.import_module("octavo.kernels.triton.decode_attention")
    grids: list = []
    kernel = getattr(module, kernel_name)

    class RecordingKernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, kernel_name, RecordingKernel())
    return grids


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
    launched = record_launches(monkeypatch, "_decode_reduce_kernel")
    batch = make_paged_batch([1, 1, 1], [190, 33, 70], num_heads=4, num_kv_heads=2,
                             head_dim=64, block_size=16)
    run_and_compare(batch, torch.float32, block_n=16, partition_size=16,
                    unsplit_min_programs=threshold)
    assert bool(launched) == expect_split


def test_decode_partitions_rule():
    # A wide batch is never split; a narrow one gets enough partitions for ~256 programs,
    # no fewer than its length needs and no more than one per key block of max_seq_len.
    assert decode_partitions(64, 8, 8192, 64, 512, 256) == 1
    assert decode_partitions(1, 8, 8192, 64, 512, 256) == 32
    assert decode_partitions(1, 8, 300, 64, 512, 256) == 5
    assert decode_partitions(2, 2, 65536, 64, 512, 256) == 128  # by length
    assert decode_partitions(1, 8, 8192, 64, 512, None) == 16  # by length only


def test_decode_wide_batch_split_rule():
    # With wide_batch_span a wide batch is split into spans of that many keys: enough
    # partitions to cover max_seq_len, each at least the span.
    from octavo.kernels.triton.decode_attention import decode_split

    assert decode_split(64, 8, 8192, 64, 512, 256, 512) == (16, 512)
    assert decode_split(64, 8, 300, 64, 512, 256, 256) == (2, 256)
    assert decode_split(64, 8, 8192, 64, 512, 256, None) == (1, 64)
    assert decode_split(1, 8, 8192, 64, 512, 256, 512) == (32, 64)  # narrow: as before
    # fill_programs: a batch that fills the GPU by itself (226 x 8 programs) is never split.
    assert decode_split(229, 2, 32768, 64, 512, 256, 768, 1024) == (32, 768)  # at most 32
    assert decode_split(229, 2, 16384, 64, 512, 256, 768, 1024) == (22, 768)
    assert decode_split(226, 8, 32768, 64, 512, 256, 768, 1024) == (1, 64)
    assert decode_partitions(64, 8, 8192, 64, 512, 256, 512) == 16


@pytest.mark.parametrize("max_seq_len", [None, 4096], ids=["eager", "graph-bound"])
def test_decode_wide_batch_split_by_span(max_seq_len):
    # 6 sequences x 2 KV heads = 12 programs >= the threshold 4: split into spans of 32 keys
    # (two key blocks of 16); a context of 1 key, one of exactly a span, one just past it. At
    # the graph bound 4096 / 32 = 128 partitions are capped at 32: the 1,500-key context
    # then gets spans of 48 keys.
    seq_lens = [1, 32, 33, 190, 77, 1500]
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2,
                             head_dim=64, block_size=16)
    run_and_compare(batch, torch.float32, max_seq_len=max_seq_len, block_n=16,
                    partition_size=16, unsplit_min_programs=4, wide_batch_span=32)


def test_decode_wide_batch_span_must_be_a_multiple_of_block_n():
    batch = make_paged_batch([1, 1], [9, 12], num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=8)
    with pytest.raises(ValueError, match="wide_batch_span"):
        run_and_compare(batch, torch.float32, block_n=16, unsplit_min_programs=1,
                        wide_batch_span=24)


@pytest.mark.parametrize("seq_lens", [[300], [700, 30, 1, 97]])
def test_decode_short_contexts_under_a_graph_bound_spread(seq_lens, monkeypatch):
    """A captured graph passes max_model_len as the bound: a narrow batch of short contexts
    is cut into many partitions, each sequence's span following its own length."""
    grids = record_launches(monkeypatch, "_decode_partition_kernel")
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, num_heads=8, num_kv_heads=2,
                             head_dim=64, block_size=16)
    run_and_compare(batch, torch.float32, max_seq_len=4096, block_n=16, partition_size=512,
                    unsplit_min_programs=64)
    partitions = grids[0][2]
    assert partitions == decode_partitions(len(seq_lens), 2, 4096, 16, 512, 64) > 1


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
@pytest.mark.parametrize("graph_bound", [False, True], ids=["eager", "graph-bound"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (16, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_full_shapes(head_dim, heads, dtype, graph_bound):
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
    # graph-bound: as a captured graph launches it (max_model_len as the bound, the
    # backend's split policy), so short contexts spread over many partitions.
    run_and_compare(batch, dtype, max_seq_len=32768 if graph_bound else None,
                    block_n=config.decode_block_n,
                    partition_size=config.decode_partition_size,
                    unsplit_min_programs=config.decode_unsplit_min_programs if graph_bound
                    else None,
                    # 9 sequences x 32 KV heads = 288 programs: split into spans when bound
                    wide_batch_span=config.decode_wide_batch_span if graph_bound else None,
                    fill_programs=config.decode_fill_programs,
                    num_warps=config.decode_num_warps, num_stages=config.decode_num_stages)
