"""The Triton kernels with an fp8 (e4m3) KV cache, a sliding window and attention logit
soft-capping all at once (Gemma 2 with ``--kv-cache-dtype fp8``), against
``paged_attention_reference`` with the same options and scales.

``k_scale`` is folded into the softmax scale before the soft cap, so a wrong order shows up
here and nowhere else. Blocks wholly before a sequence's window hold NaN bytes: a kernel that
read one would return NaN.
"""

from __future__ import annotations

import pytest
import torch
from octavo.attention.reference import (
    ReferenceAttentionBackend,
    paged_attention_reference,
    quantize_kv,
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

# e4m3fn NaN (exponent and mantissa all ones).
FP8_NAN_BYTE = 0x7F
# (k_scale, v_scale): identity, and scales that are not powers of two.
SCALES = [(1.0, 1.0), (0.3, 0.07)]


def fp8_batch(query_lens, seq_lens, k_scale, v_scale, dtype=torch.float32, **kwargs):
    """A random batch whose cache is the fp8 quantization of its random contents."""
    batch = make_paged_batch(query_lens, seq_lens, dtype=dtype, **kwargs)
    dense = batch.kv_cache
    batch.kv_cache = torch.stack([quantize_kv(dense[0], k_scale), quantize_kv(dense[1], v_scale)])
    return batch


def poison_outside_window(batch, window: int) -> int:
    """NaN bytes in the blocks wholly before each sequence's window; returns how many."""
    meta = batch.metadata
    cache_bytes = batch.kv_cache.view(torch.uint8)
    block_size = batch.kv_cache.shape[2]
    starts = meta.query_start_loc_cpu
    poisoned = 0
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        query_len = starts[i + 1] - starts[i]
        if query_len == 0:
            continue
        for b in range(window_start(seq_len, query_len, window) // block_size):
            cache_bytes[:, int(meta.block_tables[i, b])] = FP8_NAN_BYTE
            poisoned += 1
    assert batch.kv_cache.float().isnan().any() == (poisoned > 0)
    return poisoned


def expected_of(batch, window, cap, k_scale, v_scale):
    with on_device_of(batch.query):
        return paged_attention_reference(batch.query, batch.kv_cache, batch.metadata,
                                         batch.scale, window, cap, k_scale=k_scale,
                                         v_scale=v_scale)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_fp8_window_softcap(scales, dtype):
    """A prompt, chunks after a cached prefix longer than the window, a decode row and an
    empty row in one launch."""
    k_scale, v_scale = scales
    window, cap = 13, 1.5
    batch = fp8_batch([37, 7, 20, 1, 0], [37, 46, 61, 45, 16], k_scale, v_scale, dtype=dtype,
                      num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                      num_padding_tokens=1)
    meta = batch.metadata
    assert poison_outside_window(batch, window) > 0
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping, k_scale,
                       v_scale)
    out = prefill_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, meta.max_query_len, batch.scale,
                            sliding_window=window, logits_soft_cap=cap, k_scale=k_scale,
                            v_scale=v_scale, block_m=16, block_n=16)
    n = batch.num_real_tokens
    assert not out[:n].isnan().any()
    assert_close(out[:n], expected_of(batch, window, cap, k_scale, v_scale)[:n], dtype)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("partition_size", [16, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_fp8_window_softcap(scales, partition_size, dtype):
    """partition_size 16 splits the contexts, some partitions wholly before the window (the
    reduce kernel must skip them and apply v_scale once)."""
    k_scale, v_scale = scales
    window, cap = 17, 3.0
    seq_lens = [1, 9, 40, 70]
    batch = fp8_batch([1] * len(seq_lens), seq_lens, k_scale, v_scale, dtype=dtype,
                      num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                      num_padding_tokens=2)
    meta = batch.metadata
    assert poison_outside_window(batch, window) > 0
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping, k_scale,
                       v_scale)
    out = decode_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, batch.scale,
                           sliding_window=window, logits_soft_cap=cap, k_scale=k_scale,
                           v_scale=v_scale, block_n=16, partition_size=partition_size)
    n = batch.num_real_tokens
    assert not out[:n].isnan().any()
    assert_close(out[:n], expected_of(batch, window, cap, k_scale, v_scale)[:n], dtype)


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [44, 9]), ([30, 12, 1], [30, 40, 33])],
                         ids=["decode", "mixed"])
def test_backend_impl_fp8_window_softcap_matches_the_reference_impl(query_lens, seq_lens):
    """``TritonAttentionImpl`` writes the reference's fp8 bytes and attends with the layer's
    scales, window and cap, as ``ReferenceAttentionImpl`` does."""
    k_scale, v_scale = 0.25, 0.5
    batch = fp8_batch(query_lens, seq_lens, k_scale, v_scale, num_heads=4, num_kv_heads=2,
                      head_dim=64, block_size=8)
    config = TritonLaunchConfig(prefill_block_m=16, prefill_block_n=16, decode_block_n=16,
                                decode_partition_size=16)
    options = {"sliding_window": 10, "logits_soft_cap": 4.0}
    impls = [TritonAttentionBackend(config).make_impl(4, 2, 64, batch.scale, **options),
             ReferenceAttentionBackend().make_impl(4, 2, 64, batch.scale, **options)]
    caches = [batch.kv_cache.clone(), batch.kv_cache.clone()]
    outs = []
    for impl, cache in zip(impls, caches):
        impl.k_scale, impl.v_scale = k_scale, v_scale
        with on_device_of(batch.query):
            outs.append(impl.forward(batch.query, batch.key, batch.value, cache, batch.metadata))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert_close(outs[0], outs[1], torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_window_softcap_full_shapes(head_dim, dtype):
    """Gemma-2-like shapes on the GPU with the default launch settings (window 4096, cap 50,
    fp8 cache): a long prefill after a cached prefix beyond the window, and decodes of
    contexts longer than the window, split and unsplit."""
    window, cap, k_scale, v_scale = 4096, 50.0, 0.05, 0.04
    config = TritonLaunchConfig()
    prefill = fp8_batch([1000, 300, 1], [1000, 5000, 6000], k_scale, v_scale, dtype=dtype,
                        num_heads=16, num_kv_heads=8, head_dim=head_dim, block_size=16,
                        num_padding_tokens=3)
    meta = prefill.metadata
    poison_outside_window(prefill, window)
    write_kv_reference(prefill.key, prefill.value, prefill.kv_cache, meta.slot_mapping,
                       k_scale, v_scale)
    out = prefill_attention(prefill.query, prefill.kv_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, meta.max_query_len, prefill.scale,
                            sliding_window=window, logits_soft_cap=cap, k_scale=k_scale,
                            v_scale=v_scale, block_m=config.prefill_block_m,
                            block_n=config.prefill_block_n, num_warps=config.prefill_num_warps,
                            num_stages=config.prefill_num_stages)
    n = prefill.num_real_tokens
    assert_close(out[:n], expected_of(prefill, window, cap, k_scale, v_scale)[:n], dtype)
    decode = fp8_batch([1] * 4, [5000, 100, 8193, 4097], k_scale, v_scale, dtype=dtype,
                       num_heads=16, num_kv_heads=8, head_dim=head_dim, block_size=16)
    meta = decode.metadata
    poison_outside_window(decode, window)
    write_kv_reference(decode.key, decode.value, decode.kv_cache, meta.slot_mapping, k_scale,
                       v_scale)
    for unsplit in (None, 1):
        out = decode_attention(decode.query, decode.kv_cache, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, meta.max_seq_len, decode.scale,
                               sliding_window=window, logits_soft_cap=cap, k_scale=k_scale,
                               v_scale=v_scale, block_n=config.decode_block_n,
                               partition_size=config.decode_partition_size,
                               unsplit_min_programs=unsplit, num_warps=config.decode_num_warps,
                               num_stages=config.decode_num_stages)
        assert_close(out[:4], expected_of(decode, window, cap, k_scale, v_scale)[:4], dtype)
