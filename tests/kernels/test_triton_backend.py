"""``TritonAttentionBackend`` / ``TritonAttentionImpl`` against ``ReferenceAttentionImpl``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import octavo.kernels.triton.attention as triton_attention
from octavo.attention.base import AttentionBackend
from octavo.attention.reference import ReferenceAttentionImpl
from octavo.kernels.triton import TritonAttentionBackend, TritonAttentionImpl, TritonLaunchConfig
from tests.kernels.conftest import HAS_CUDA, assert_close, make_paged_batch, on_device_of

# Small tiles so the interpreter covers several tiles / partitions on small shapes.
SMALL = TritonLaunchConfig(
    prefill_block_m=16, prefill_block_n=16, decode_block_n=16, decode_partition_size=32
)


def _forward_both(batch, num_heads, num_kv_heads, head_dim, config=SMALL):
    """Run the Triton and the reference impl on copies of one cache; return both results."""
    impl = TritonAttentionBackend(config).make_impl(num_heads, num_kv_heads, head_dim, batch.scale)
    reference = ReferenceAttentionImpl(num_heads, num_kv_heads, head_dim, batch.scale)
    ref_cache = batch.kv_cache.clone()
    with on_device_of(batch.query):
        expected = reference.forward(
            batch.query, batch.key, batch.value, ref_cache, batch.metadata
        )
    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    n = batch.num_real_tokens
    return out[:n], expected[:n], batch.kv_cache, ref_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_forward_mixed_batch(dtype, head_dim):
    # Sequence 0: whole prompt of 2 blocks + 3. Sequence 1: a chunk after a cached prefix whose
    # first block is sequence 0's first block, written in this same step. Sequences 2, 3:
    # decode rows (one on a block boundary). Then two padding rows.
    batch = make_paged_batch(
        [19, 5, 1, 1],
        [19, 21, 33, 16],
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=8,
        dtype=dtype,
        num_padding_tokens=2,
        shared_first_block=(0, 1),
    )
    assert not batch.metadata.is_pure_decode
    out, expected, cache, ref_cache = _forward_both(batch, 4, 2, head_dim)
    assert_close(out, expected, dtype)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_forward_pure_decode_uses_decode_kernel(dtype, monkeypatch):
    calls = []
    real_decode = triton_attention.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["partition_size"])
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "decode_attention", spy)
    batch = make_paged_batch([1, 1, 1], [1, 40, 77], num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, dtype=dtype)
    assert batch.metadata.is_pure_decode
    out, expected, cache, ref_cache = _forward_both(batch, 8, 2, 64)
    assert calls == [SMALL.decode_partition_size]
    assert_close(out, expected, dtype)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)


def test_forward_default_config_mqa():
    batch = make_paged_batch([12, 1], [30, 50], num_heads=4, num_kv_heads=1, head_dim=96,
                             block_size=16)
    out, expected, _, _ = _forward_both(batch, 4, 1, 96, config=TritonLaunchConfig())
    assert_close(out, expected, torch.float32)


def test_backend_surface():
    backend = TritonAttentionBackend()
    assert isinstance(backend, AttentionBackend)
    assert backend.name == "triton"
    assert backend.supported_head_dims() == (64, 80, 96, 128, 256)
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    impl = backend.make_impl(8, 2, 128, 0.1)
    assert isinstance(impl, TritonAttentionImpl) and impl.config == TritonLaunchConfig()
    with pytest.raises(ValueError, match="head_dim 72"):
        backend.make_impl(8, 2, 72, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        backend.make_impl(6, 4, 64, 0.1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prefill_block_m=8), "prefill_block_m"),
        (dict(prefill_block_n=48), "prefill_block_n"),
        (dict(decode_block_n=64, decode_partition_size=96), "multiple of decode_block_n"),
        (dict(decode_num_warps=3), "decode_num_warps"),
        (dict(prefill_num_stages=0), "prefill_num_stages"),
        (dict(fp32_dot_precision="bf16"), "fp32_dot_precision"),
    ],
)
def test_launch_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TritonLaunchConfig(**kwargs)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-without-interpreter error")
def test_forward_rejects_cpu_without_interpreter(monkeypatch):
    batch = make_paged_batch([2], [2], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8)
    impl = TritonAttentionBackend().make_impl(2, 2, 64, batch.scale)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)


def test_import_octavo_kernels_does_not_import_triton():
    code = "import sys, octavo.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
