"""The Triton prefill and decode kernels with a sliding window and attention logit soft-capping,
against ``paged_attention_reference`` with the same options.

Blocks that lie wholly before a sequence's window are filled with NaN before the kernel runs:
under a sliding window the KV cache manager may have handed them to another request, so a
kernel must never read them (one NaN read would poison the output).
"""

from __future__ import annotations

import pytest
import torch
from octavo.attention.reference import (
    paged_attention_reference,
    window_start,
    write_kv_reference,
)
from octavo.kernels.triton import (
    TritonAttentionBackend,
    TritonLaunchConfig,
    decode_attention,
    prefill_attention,
)

from tests.kernels.conftest import DTYPES, assert_close, make_paged_batch, on_device_of


def poison_outside_window(batch, window: int | None) -> int:
    """Fill the blocks wholly before each sequence's window with NaN; returns how many."""
    if window is None:
        return 0
    meta = batch.metadata
    block_size = batch.kv_cache.shape[2]
    starts = meta.query_start_loc_cpu
    poisoned = 0
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        query_len = starts[i + 1] - starts[i]
        if query_len == 0:
            continue
        first = window_start(seq_len, query_len, window)
        for b in range(first // block_size):
            batch.kv_cache[:, int(meta.block_tables[i, b])] = float("nan")
            poisoned += 1
    return poisoned


def expected_of(batch, window, cap):
    with on_device_of(batch.query):
        return paged_attention_reference(batch.query, batch.kv_cache, batch.metadata,
                                         batch.scale, window, cap)


def run_prefill(batch, window, cap, **launch):
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    return prefill_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.max_query_len, batch.scale, sliding_window=window, logits_soft_cap=cap, **launch,
    )


def run_decode(batch, window, cap, max_seq_len=None, **launch):
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping)
    return decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.max_seq_len if max_seq_len is None else max_seq_len, batch.scale,
        sliding_window=window, logits_soft_cap=cap, **launch,
    )


# (window, soft cap): window alone (smaller than a block, a few blocks), cap alone, both.
OPTIONS = [(3, None), (21, None), (None, 2.0), (13, 1.5)]
OPTION_IDS = ["window3", "window21", "cap2", "window13-cap1.5"]


@pytest.mark.parametrize(("window", "cap"), OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_window_softcap(window, cap, block_size):
    # A prompt, chunks after a cached prefix (short and long), a decode row and an empty row.
    batch = make_paged_batch(
        [37, 7, 20, 1, 0], [37, 2 * block_size + 30, 61, 45, block_size],
        num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, num_padding_tokens=1,
    )
    poisoned = poison_outside_window(batch, window)
    assert window is None or window > 20 or poisoned > 0, "the test must poison some block"
    out = run_prefill(batch, window, cap, block_m=16, block_n=16)
    n = batch.num_real_tokens
    assert_close(out[:n], expected_of(batch, window, cap)[:n], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_window_softcap_dtypes_gqa(dtype):
    batch = make_paged_batch(
        [33, 5], [33, 50], num_heads=6, num_kv_heads=2, head_dim=80, block_size=8, dtype=dtype,
    )
    poison_outside_window(batch, 9)
    out = run_prefill(batch, 9, 5.0, block_m=16, block_n=16)
    n = batch.num_real_tokens
    assert_close(out[:n], expected_of(batch, 9, 5.0)[:n], dtype)


@pytest.mark.parametrize(("window", "cap"), OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("partition_size", [16, 512])
def test_decode_window_softcap(window, cap, partition_size):
    # partition_size 16 splits every context into partitions, some wholly before the window.
    seq_lens = [1, 3, 8, 25, 70, 41]
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        num_padding_tokens=2,
    )
    poison_outside_window(batch, window)
    out = run_decode(batch, window, cap, block_n=16, partition_size=partition_size)
    n = batch.num_real_tokens
    assert_close(out[:n], expected_of(batch, window, cap)[:n], torch.float32)


@pytest.mark.parametrize(("window", "cap"), OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("split", [dict(unsplit_min_programs=128),
                                   dict(unsplit_min_programs=4, wide_batch_span=16)],
                         ids=["narrow", "wide-spans"])
def test_decode_window_softcap_graph_bound(window, cap, split):
    # A graph's bound (max_model_len). Narrow: a small batch cut into many partitions per
    # sequence, spans from each sequence's own length. Wide spans: the same 12 programs as a
    # wide batch (>= 4) split into spans of 16 keys. Either way some spans lie wholly before
    # the window (they exit; the reduce kernel starts after them).
    seq_lens = [1, 3, 8, 25, 70, 41]
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        num_padding_tokens=2,
    )
    poison_outside_window(batch, window)
    out = run_decode(batch, window, cap, max_seq_len=2048, block_n=16, partition_size=512,
                     **split)
    n = batch.num_real_tokens
    assert_close(out[:n], expected_of(batch, window, cap)[:n], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_window_softcap_dtypes(dtype):
    seq_lens = [9, 40, 66]
    batch = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
        dtype=dtype,
    )
    poison_outside_window(batch, 17)
    out = run_decode(batch, 17, 3.0, block_n=16, partition_size=16)
    n = batch.num_real_tokens
    assert_close(out[:n], expected_of(batch, 17, 3.0)[:n], dtype)


def test_softcap_saturates_without_overflow():
    """Huge scores: tanh saturates at +-cap, nothing overflows to inf or NaN."""
    batch = make_paged_batch([12], [12], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8)
    batch.query.mul_(1e4)
    out = run_prefill(batch, None, 1.0, block_m=16, block_n=16)
    assert torch.isfinite(out).all()
    assert_close(out, expected_of(batch, None, 1.0), torch.float32)


def test_backend_forwards_options():
    """``TritonAttentionBackend`` declares both options and its impl applies them (prefill,
    then a pure-decode step on the same cache)."""
    backend = TritonAttentionBackend(TritonLaunchConfig(prefill_block_m=16, prefill_block_n=16,
                                                        decode_block_n=16,
                                                        decode_partition_size=16))
    assert backend.supports_sliding_window and backend.supports_logits_soft_cap
    impl = backend.make_impl(4, 2, 64, 0.125, sliding_window=10, logits_soft_cap=4.0)
    assert (impl.sliding_window, impl.logits_soft_cap) == (10, 4.0)
    prefill = make_paged_batch([30, 12], [30, 40], num_heads=4, num_kv_heads=2, head_dim=64,
                               block_size=8)
    prefill.scale = 0.125
    poison_outside_window(prefill, 10)
    out = impl.forward(prefill.query, prefill.key, prefill.value, prefill.kv_cache,
                       prefill.metadata)
    assert_close(out, expected_of(prefill, 10, 4.0), torch.float32)
    decode = make_paged_batch([1, 1], [44, 9], num_heads=4, num_kv_heads=2, head_dim=64,
                              block_size=8, seed=3)
    decode.scale = 0.125
    poison_outside_window(decode, 10)
    out = impl.forward(decode.query, decode.key, decode.value, decode.kv_cache, decode.metadata)
    assert_close(out, expected_of(decode, 10, 4.0), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("window", "cap"), [(4096, None), (4096, 50.0), (1024, 50.0)],
                         ids=["mistral-window", "gemma2-window-cap", "small-window-cap"])
def test_window_softcap_full_shapes(head_dim, dtype, window, cap):
    """Full shapes on the GPU with the default launch settings: a long prefill after a cached
    prefix beyond the window, and decodes of contexts longer than the window."""
    config = TritonLaunchConfig()
    prefill = make_paged_batch(
        [1000, 300, 1], [1000, 5000, 6000], num_heads=16, num_kv_heads=8, head_dim=head_dim,
        block_size=16, dtype=dtype, num_padding_tokens=3,
    )
    poison_outside_window(prefill, window)
    out = run_prefill(prefill, window, cap, block_m=config.prefill_block_m,
                      block_n=config.prefill_block_n, num_warps=config.prefill_num_warps,
                      num_stages=config.prefill_num_stages)
    n = prefill.num_real_tokens
    assert_close(out[:n], expected_of(prefill, window, cap)[:n], dtype)
    seq_lens = [5000, 100, 8193, 4097]
    decode = make_paged_batch([1] * 4, seq_lens, num_heads=16, num_kv_heads=8,
                              head_dim=head_dim, block_size=16, dtype=dtype)
    poison_outside_window(decode, window)
    out = run_decode(decode, window, cap, block_n=config.decode_block_n,
                     partition_size=config.decode_partition_size,
                     num_warps=config.decode_num_warps, num_stages=config.decode_num_stages)
    assert_close(out[:4], expected_of(decode, window, cap)[:4], dtype)
