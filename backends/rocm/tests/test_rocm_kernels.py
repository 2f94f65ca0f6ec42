"""The portable Triton kernels with the ROCm backend's launch parameters, against the reference.

Without a GPU these run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, see conftest.py).
The interpreter honours the tile sizes and the decode partition size, so the tiling, masking,
partition and reduce paths the ROCm config selects are checked here; it ignores ``num_warps``
and ``num_stages``, and compiles nothing for AMD, so those (and speed) are NOT checked here.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from octavo.attention.reference import ReferenceAttentionImpl
from octavo.kernels.triton import TritonLaunchConfig
from octavo_rocm.attention import ROCM_LAUNCH_CONFIG, make_attention_backend

from tests.kernels.conftest import assert_close, make_paged_batch, on_device_of

CONFIG = ROCM_LAUNCH_CONFIG


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# ---- the launch configuration --------------------------------------------------------------------


def test_launch_config_meets_the_kernels_constraints():
    # Tile sides: powers of two (tl.arange) and >= 16 (tl.dot; also the smallest 16-bit MFMA
    # tile on CDNA).
    for name in ("prefill_block_m", "prefill_block_n", "decode_block_n"):
        value = getattr(CONFIG, name)
        assert _is_power_of_two(value) and value >= 16, (name, value)
    assert CONFIG.decode_partition_size % CONFIG.decode_block_n == 0
    # Wavefronts: powers of two, and a workgroup of at most 1024 threads (64 per wavefront).
    for name in ("prefill_num_warps", "decode_num_warps", "cache_write_num_warps"):
        value = getattr(CONFIG, name)
        assert _is_power_of_two(value) and value * 64 <= 1024, (name, value)
    assert CONFIG.prefill_num_stages >= 1 and CONFIG.decode_num_stages >= 1
    assert CONFIG.fp32_dot_precision == "ieee"  # the one precision every AMD target accepts
    # The core's own validation accepts it too (it ran at import; run it again explicitly).
    assert TritonLaunchConfig(**asdict(CONFIG)) == CONFIG


def test_launch_config_is_the_amd_one():
    """The choices docs/rocm.md explains, relative to the NVIDIA defaults."""
    nvidia = TritonLaunchConfig()
    # 64-wide wavefronts: the decode and cache-write programs keep NVIDIA's thread count
    # (2 x 64 = 4 x 32) with half the wavefronts.
    assert CONFIG.decode_num_warps * 64 == nvidia.decode_num_warps * 32
    assert CONFIG.cache_write_num_warps * 64 == nvidia.cache_write_num_warps * 32
    # Smaller decode tiles and partitions: more programs for MI300X's 304 CUs.
    assert CONFIG.decode_block_n < nvidia.decode_block_n
    assert CONFIG.decode_partition_size < nvidia.decode_partition_size
    # Single-stage loops: K and V tiles of one step fit a CDNA3 CU's 64 KB LDS with room to
    # spare at head dim 128 (16-bit), and at 256 where the prefill kernel halves block_n.
    lds = 64 * 1024
    for head_dim, block_n in ((128, CONFIG.prefill_block_n), (256, CONFIG.prefill_block_n // 2)):
        assert 2 * block_n * head_dim * 2 * CONFIG.prefill_num_stages <= lds // 2
    assert 2 * CONFIG.decode_block_n * 256 * 2 * CONFIG.decode_num_stages <= lds // 2


# ---- the kernels with this configuration ---------------------------------------------------------


def _forward_both(batch, num_heads, num_kv_heads, head_dim):
    """ROCm-configured Triton impl and the reference on copies of one cache."""
    backend = make_attention_backend(model_config=None, cache_config=None)
    assert backend.config is CONFIG
    impl = backend.make_impl(num_heads, num_kv_heads, head_dim, batch.scale)
    reference = ReferenceAttentionImpl(num_heads, num_kv_heads, head_dim, batch.scale)
    ref_cache = batch.kv_cache.clone()
    with on_device_of(batch.query):
        expected = reference.forward(batch.query, batch.key, batch.value, ref_cache,
                                     batch.metadata)
    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    n = batch.num_real_tokens
    return out[:n], expected[:n], batch.kv_cache, ref_cache


@pytest.mark.parametrize(
    "heads, head_dim, dtype",
    [
        ((4, 2), 64, torch.float32),
        ((8, 2), 128, torch.float16),  # GQA group 4
        ((4, 1), 80, torch.bfloat16),  # MQA, head dim padded to 128 inside the kernels
    ],
    ids=["4q2kv-d64-fp32", "8q2kv-d128-fp16", "4q1kv-d80-bf16"],
)
def test_mixed_prefill_and_decode_step(heads, head_dim, dtype):
    # Sequence 0: a whole 70-token prompt (more than one 64-row tile); sequence 1: a chunk of 9
    # after a cached prefix whose first block is sequence 0's, written this same step;
    # sequences 2, 3: decode rows; then padding rows.
    num_heads, num_kv_heads = heads
    batch = make_paged_batch([70, 9, 1, 1], [70, 75, 40, 16], num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                             dtype=dtype, num_padding_tokens=2, shared_first_block=(0, 1))
    assert not batch.metadata.is_pure_decode
    out, expected, cache, ref_cache = _forward_both(batch, num_heads, num_kv_heads, head_dim)
    assert_close(out, expected, dtype)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize(
    "heads, head_dim, dtype",
    [((8, 2), 64, torch.float32), ((4, 1), 128, torch.float16)],
    ids=["8q2kv-d64-fp32", "4q1kv-d128-fp16"],
)
def test_decode_across_partitions(heads, head_dim, dtype):
    # Contexts of one token, one 32-key tile + 1, exactly one 256-key partition, and three
    # partitions (the reduce kernel), with 16-token cache blocks.
    num_heads, num_kv_heads = heads
    seq_lens = [1, 33, CONFIG.decode_partition_size, 2 * CONFIG.decode_partition_size + 50]
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                             dtype=dtype, num_padding_tokens=1)
    assert batch.metadata.is_pure_decode
    out, expected, cache, ref_cache = _forward_both(batch, num_heads, num_kv_heads, head_dim)
    assert_close(out, expected, dtype)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)


def test_prefill_head_dim_256():
    # Head dims above 128 make the prefill kernel halve block_n (64 -> 32).
    batch = make_paged_batch([20, 1], [36, 9], num_heads=4, num_kv_heads=2, head_dim=256,
                             block_size=8, dtype=torch.float16)
    out, expected, _, _ = _forward_both(batch, 4, 2, 256)
    assert_close(out, expected, torch.float16)


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_declared_block_sizes(block_size):
    # The block sizes the ROCm backend declares, on a mixed step with a multi-partition decode.
    seq_lens = [45, 2 * CONFIG.decode_partition_size + 3]
    batch = make_paged_batch([45, 1], seq_lens, num_heads=6, num_kv_heads=2, head_dim=64,
                             block_size=block_size, num_padding_tokens=1)
    out, expected, cache, ref_cache = _forward_both(batch, 6, 2, 64)
    assert_close(out, expected, torch.float32)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    decode = make_paged_batch([1, 1], seq_lens, num_heads=6, num_kv_heads=2, head_dim=64,
                              block_size=block_size, seed=1)
    out, expected, _, _ = _forward_both(decode, 6, 2, 64)
    assert_close(out, expected, torch.float32)
