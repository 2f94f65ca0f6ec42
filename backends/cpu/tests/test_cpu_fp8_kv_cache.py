"""The CPU backend's attention on an fp8 (e4m3) KV cache against ``octavo.attention.reference``.

An fp8 cache always takes the torch path (decode rows batched, prefill rows one by one); it
must store the reference's bytes and read them back times the layer's per-tensor scales.
"""

from __future__ import annotations

import pytest
import torch
from octavo.attention.reference import ReferenceAttentionImpl, quantize_kv
from octavo_cpu.attention import CPUAttentionBackend
from test_cpu_attention import MIXED, _build_step  # this folder (rootdir-less import)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 0.3)], ids=str)
def test_mixed_step_on_an_fp8_cache_matches_the_reference(dtype, scales):
    num_heads, num_kv_heads = 4, 2
    dense, metadata, gen = _build_step(MIXED, num_kv_heads, torch.float32)
    k_scale, v_scale = scales
    # NaN slots stay NaN in e4m3: unused slots must still never reach a result.
    cache = torch.stack([quantize_kv(dense[0], k_scale), quantize_kv(dense[1], v_scale)])
    tokens = metadata.num_tokens
    query = torch.randn(tokens, num_heads, 16, generator=gen).to(dtype)
    key = torch.randn(tokens, num_kv_heads, 16, generator=gen).to(dtype)
    value = torch.randn(tokens, num_kv_heads, 16, generator=gen).to(dtype)
    impls = [CPUAttentionBackend().make_impl(num_heads, num_kv_heads, 16, 0.25),
             ReferenceAttentionImpl(num_heads, num_kv_heads, 16, 0.25)]
    caches, outs = [cache.clone(), cache.clone()], []
    for impl, kv in zip(impls, caches):
        impl.k_scale, impl.v_scale = k_scale, v_scale
        outs.append(impl.forward(query, key, value, kv, metadata))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert not outs[0].isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window, cap", [(5, None), (None, 1.5), (6, 2.0)],
                         ids=["window5", "cap1.5", "window6-cap2"])
def test_fp8_cache_with_window_and_soft_cap_matches_the_reference(dtype, window, cap):
    """The torch path's window mask and soft cap on an fp8 cache read with non-unit scales
    (a Gemma 2 layer under --kv-cache-dtype fp8)."""
    num_heads, num_kv_heads = 4, 2
    dense, metadata, gen = _build_step(MIXED, num_kv_heads, torch.float32, seed=1)
    k_scale, v_scale = 0.5, 0.3
    cache = torch.stack([quantize_kv(dense[0], k_scale), quantize_kv(dense[1], v_scale)])
    tokens = metadata.num_tokens
    query = torch.randn(tokens, num_heads, 16, generator=gen).to(dtype)
    key = torch.randn(tokens, num_kv_heads, 16, generator=gen).to(dtype)
    value = torch.randn(tokens, num_kv_heads, 16, generator=gen).to(dtype)
    options = {"sliding_window": window, "logits_soft_cap": cap}
    impls = [CPUAttentionBackend().make_impl(num_heads, num_kv_heads, 16, 0.25, **options),
             ReferenceAttentionImpl(num_heads, num_kv_heads, 16, 0.25, window, cap)]
    caches, outs = [cache.clone(), cache.clone()], []
    for impl, kv in zip(impls, caches):
        impl.k_scale, impl.v_scale = k_scale, v_scale
        outs.append(impl.forward(query, key, value, kv, metadata))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert not outs[0].isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tolerance, rtol=tolerance)
    # The options changed the result (else this test would not check them).
    plain = ReferenceAttentionImpl(num_heads, num_kv_heads, 16, 0.25)
    plain.k_scale, plain.v_scale = k_scale, v_scale
    assert not torch.allclose(plain.forward(query, key, value, cache.clone(), metadata).float(),
                              outs[1].float(), atol=1e-3)
