"""fp8 (e4m3) KV cache in the Triton kernels against the torch reference.

The write kernel must store exactly what ``octavo.attention.reference.quantize_kv`` stores
(``x / scale`` saturated to +-448, rounded to nearest even); decode and prefill must read an fp8
cache as the reference does (values times ``k_scale``/``v_scale``), within the query dtype's
tolerance. Scales are per tensor: powers of two and not, and large enough inputs to saturate.
"""

from __future__ import annotations

import pytest
import torch
from octavo.attention.reference import (
    ReferenceAttentionBackend,
    paged_attention_reference,
    quantize_kv,
    write_kv_reference,
)
from octavo.kernels.triton import (
    TritonAttentionBackend,
    TritonLaunchConfig,
    decode_attention,
    prefill_attention,
    write_kv_cache,
)

from tests.kernels.conftest import DTYPES, assert_close, make_paged_batch, on_device_of

FP8 = torch.float8_e4m3fn
SCALES = [(1.0, 1.0), (0.5, 2.0), (0.3, 0.07)]


def fp8_batch(query_lens, seq_lens, k_scale, v_scale, dtype=torch.float32, **kwargs):
    """A random batch whose cache is the fp8 quantization of its random contents."""
    batch = make_paged_batch(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=8, dtype=dtype, **kwargs)
    dense = batch.kv_cache
    batch.kv_cache = torch.stack([quantize_kv(dense[0], k_scale), quantize_kv(dense[1], v_scale)])
    return batch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scales", SCALES, ids=str)
def test_write_stores_exactly_the_reference_bytes(dtype, scales):
    k_scale, v_scale = scales
    batch = fp8_batch([3, 1, 5], [7, 9, 5], k_scale, v_scale, dtype=dtype, num_padding_tokens=2)
    key = batch.key * 200  # some values pass 448 * scale: they must saturate, not overflow
    value = batch.value
    expected = batch.kv_cache.clone()
    write_kv_reference(key, value, expected, batch.metadata.slot_mapping, k_scale, v_scale)
    write_kv_cache(key, value, batch.kv_cache, batch.metadata.slot_mapping, k_scale=k_scale,
                   v_scale=v_scale)
    assert torch.equal(batch.kv_cache.view(torch.uint8), expected.view(torch.uint8))
    assert not batch.kv_cache.float().isnan().any()
    assert batch.kv_cache[0].float().abs().max() == 448.0  # saturated keys


def test_reference_quantization_is_e4m3_round_to_nearest_with_saturation():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, -3.3, 500.0, -1e6, 0.001])
    got = quantize_kv(x, 0.5).float()
    # x / 0.5 rounded to e4m3 (3 mantissa bits; ties to even), +-448 at most.
    assert got.tolist() == [0.0, 2.0, 2.0, 2.5, -6.5, 448.0, -448.0, 0.001953125]


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("partition_size", [16, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_reads_an_fp8_cache_like_the_reference(scales, partition_size, dtype):
    k_scale, v_scale = scales
    seq_lens = [1, 9, 33, 20]
    batch = fp8_batch([1] * len(seq_lens), seq_lens, k_scale, v_scale, dtype=dtype)
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping, k_scale,
                       v_scale)
    out = decode_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, batch.scale,
                           k_scale=k_scale, v_scale=v_scale, block_n=16,
                           partition_size=partition_size)
    with on_device_of(batch.query):
        expected = paged_attention_reference(batch.query, batch.kv_cache, meta, batch.scale,
                                             k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_reads_an_fp8_cache_like_the_reference(scales, dtype):
    """Whole prompts, a chunk after a cached prefix and a decode row in one step."""
    k_scale, v_scale = scales
    batch = fp8_batch([9, 4, 1], [9, 21, 13], k_scale, v_scale, dtype=dtype)
    meta = batch.metadata
    write_kv_reference(batch.key, batch.value, batch.kv_cache, meta.slot_mapping, k_scale,
                       v_scale)
    out = prefill_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, meta.max_query_len, batch.scale,
                            k_scale=k_scale, v_scale=v_scale, block_m=16, block_n=16)
    with on_device_of(batch.query):
        expected = paged_attention_reference(batch.query, batch.kv_cache, meta, batch.scale,
                                             k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1], [12, 30]), ([6, 1], [6, 17])],
                         ids=["decode", "mixed"])
def test_backend_impl_with_scales_matches_the_reference_impl(query_lens, seq_lens):
    """``TritonAttentionImpl`` passes its layer's scales to the write and the attention."""
    batch = fp8_batch(query_lens, seq_lens, 0.25, 0.5)
    config = TritonLaunchConfig(prefill_block_m=16, prefill_block_n=16, decode_block_n=16)
    impls = [TritonAttentionBackend(config).make_impl(4, 2, 64, batch.scale),
             ReferenceAttentionBackend().make_impl(4, 2, 64, batch.scale)]
    caches = [batch.kv_cache.clone(), batch.kv_cache.clone()]
    outs = []
    for impl, cache in zip(impls, caches):
        impl.k_scale, impl.v_scale = 0.25, 0.5
        with on_device_of(batch.query):
            outs.append(impl.forward(batch.query, batch.key, batch.value, cache, batch.metadata))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert_close(outs[0], outs[1], torch.float32)


def test_fp8_cache_stays_close_to_the_unquantized_attention():
    """What e4m3 costs: attention over the quantized cache is within a few hundredths of the
    float32 one on unit-variance K/V (3 mantissa bits: relative rounding <= 1/16)."""
    seq_lens = [40, 25]
    dense = make_paged_batch([1, 1], seq_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=8)
    meta = dense.metadata
    write_kv_reference(dense.key, dense.value, dense.kv_cache, meta.slot_mapping)
    fp8_cache = torch.stack([quantize_kv(dense.kv_cache[0], 1.0),
                             quantize_kv(dense.kv_cache[1], 1.0)])
    out = decode_attention(dense.query, fp8_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, dense.scale, block_n=16)
    with on_device_of(dense.query):
        exact = paged_attention_reference(dense.query, dense.kv_cache, meta, dense.scale)
    error = (out - exact).abs().max().item()
    assert 0 < error < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_cache_full_shapes_on_gpu(dtype):
    """Llama-3-8B attention shapes (32 query / 8 KV heads, head 128, block 16) on the GPU:
    write + decode over 2k-token contexts and a 512-token prefill, against the reference."""
    k_scale, v_scale = 0.05, 0.04
    batch = make_paged_batch([512, 1, 1], [512, 2048, 1500], num_heads=32, num_kv_heads=8,
                             head_dim=128, block_size=16, dtype=dtype)
    dense = batch.kv_cache
    batch.kv_cache = torch.stack([quantize_kv(dense[0], k_scale), quantize_kv(dense[1], v_scale)])
    meta = batch.metadata
    expected_cache = batch.kv_cache.clone()
    write_kv_reference(batch.key, batch.value, expected_cache, meta.slot_mapping, k_scale,
                       v_scale)
    write_kv_cache(batch.key, batch.value, batch.kv_cache, meta.slot_mapping, k_scale=k_scale,
                   v_scale=v_scale)
    assert torch.equal(batch.kv_cache.view(torch.uint8), expected_cache.view(torch.uint8))
    out = prefill_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, meta.max_query_len, batch.scale,
                            k_scale=k_scale, v_scale=v_scale)
    with on_device_of(batch.query):
        expected = paged_attention_reference(batch.query, batch.kv_cache, meta, batch.scale,
                                             k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, dtype)
    decode = make_paged_batch([1] * 4, [2048, 1500, 700, 33], num_heads=32, num_kv_heads=8,
                              head_dim=128, block_size=16, dtype=dtype, seed=1)
    decode.kv_cache = torch.stack([quantize_kv(decode.kv_cache[0], k_scale),
                                   quantize_kv(decode.kv_cache[1], v_scale)])
    meta = decode.metadata
    write_kv_cache(decode.key, decode.value, decode.kv_cache, meta.slot_mapping,
                   k_scale=k_scale, v_scale=v_scale)
    out = decode_attention(decode.query, decode.kv_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.max_seq_len, decode.scale,
                           k_scale=k_scale, v_scale=v_scale)
    with on_device_of(decode.query):
        expected = paged_attention_reference(decode.query, decode.kv_cache, meta, decode.scale,
                                             k_scale=k_scale, v_scale=v_scale)
    assert_close(out, expected, dtype)


def test_rounding_helper_gives_torch_cast_bits_on_every_range():
    """``round_to_e4m3`` then the cast equals torch's cast: normal and subnormal values, ties,
    saturation and signed zeros (the interpreter's own cast alone gets carries wrong)."""
    special = torch.tensor([-0.0, 0.0, 1e30, -1e30, 31.23, -1e-30, 464.0, -0.001953125])
    x = torch.cat([torch.randn(1024) * 100, torch.randn(1024) * 0.01, torch.randn(1024) * 1e-3,
                   (torch.arange(1016) - 508).float() * 0.25,  # many exact ties
                   special]).view(16, 1, 256)  # 16 tokens of one 256-wide head
    kv = torch.empty(2, 1, 16, 1, 256, dtype=FP8)
    write_kv_cache(x, x, kv, torch.arange(16))
    expected = x.clamp(-448, 448).to(FP8)
    assert torch.equal(kv[0, 0].view(torch.uint8), expected.view(torch.uint8))
