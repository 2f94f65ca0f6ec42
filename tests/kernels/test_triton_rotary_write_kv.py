"""The rotation and the KV-cache write in one launch (``apply_rotary_write_kv``) against the two
kernels it replaces (``apply_rotary``, then ``write_kv_cache``), and the attention layer's
``forward_rotary`` on the Triton backend against rotating first and calling ``forward``."""

from __future__ import annotations

import pytest
import torch
from octavo.attention.reference import ReferenceAttentionImpl
from octavo.kernels.triton import TritonAttentionBackend, apply_rotary
from octavo.kernels.triton.cache_write import write_kv_cache
from octavo.kernels.triton.rotary import apply_rotary_write_kv
from octavo.model_executor.layers import RopeParameters, RotaryEmbedding

from tests.kernels.conftest import DEVICE, DTYPES, make_paged_batch
from tests.kernels.test_triton_backend import SMALL
from tests.kernels.test_triton_fused import MAX_POSITIONS, fused_qkv_views


def make_rope(head_dim: int, partial: float = 1.0) -> RotaryEmbedding:
    params = RopeParameters("default", 10000.0, partial_rotary_factor=partial)
    return RotaryEmbedding(head_dim, MAX_POSITIONS, params).to(DEVICE)


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                       generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (32, 8, 128),
                                                              (20, 20, 32), (3, 1, 80)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_launch_equals_rotary_then_cache_write(dtype, num_heads, num_kv_heads, head_dim):
    """Bit-identical query and cache, for strided views of one QKV tensor; a padding token
    (slot -1) writes nothing; key and value stay as they were. (20, 20): key heads in two
    programs' blocks."""
    positions = torch.tensor([0, 7, 300, 1025, 4095, 12], device=DEVICE)
    q, k, v, _ = fused_qkv_views(len(positions), num_heads, num_kv_heads, head_dim, dtype)
    k_before, v_before = k.clone(), v.clone()
    slots = torch.tensor([3, 17, 40, -1, 8, 63], device=DEVICE)
    rope = make_rope(head_dim)
    expected_cache = random_cache(4, 16, num_kv_heads, head_dim, dtype)
    cache = expected_cache.clone()
    q_ref, k_ref = apply_rotary(positions, q, k, rope.cos_sin_cache)
    write_kv_cache(k_ref, v, expected_cache, slots)
    q_out = apply_rotary_write_kv(positions, q, k, v, rope.cos_sin_cache, cache, slots)
    assert q_out.is_contiguous()
    assert torch.equal(q_out, q_ref)
    assert torch.equal(cache, expected_cache)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_one_launch_with_no_tokens_and_bad_inputs():
    rope = make_rope(64)
    cache = random_cache(2, 16, 2, 64, torch.float32)
    q, k, v, _ = fused_qkv_views(0, 4, 2, 64, torch.float32)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert apply_rotary_write_kv(empty, q, k, v, rope.cos_sin_cache, cache, empty).shape == \
        (0, 4, 64)
    q, k, v, _ = fused_qkv_views(3, 4, 2, 64, torch.float32)
    positions = torch.tensor([0, 1, 2], device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="fp8 caches take write_kv_cache"):
        apply_rotary_write_kv(positions, q, k, v, rope.cos_sin_cache,
                              cache.to(torch.bfloat16), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        apply_rotary_write_kv(positions, q, k, v, rope.cos_sin_cache, cache, slots[:2])
    with pytest.raises(ValueError, match="cos_sin_cache shape"):
        apply_rotary_write_kv(positions, q, k, v, rope.cos_sin_cache[:, :32], cache, slots)


def _paged(dtype, query_lens, seq_lens):
    return make_paged_batch(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                            block_size=8, dtype=dtype, num_padding_tokens=1)


def _positions(query_lens, seq_lens, padding):
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    return torch.tensor(positions + [0] * padding, device=DEVICE)


@pytest.mark.parametrize("lens", [([1, 1, 1], [9, 30, 17]), ([12, 1, 3], [12, 25, 20])],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_forward_rotary_equals_rotating_then_forward(dtype, lens, monkeypatch):
    """The fused path (rotation and cache write in one launch) gives the same attention output
    and the same cache as ``RotaryEmbedding`` followed by ``forward``, on decode and mixed
    steps."""
    import octavo.kernels.triton.attention as triton_attention

    query_lens, seq_lens = lens
    batch = _paged(dtype, query_lens, seq_lens)
    positions = _positions(query_lens, seq_lens, 1)
    rope = make_rope(64)
    impl = TritonAttentionBackend(SMALL).make_impl(8, 2, 64, batch.scale)
    ref_cache = batch.kv_cache.clone()
    q_rot, k_rot = rope(positions, batch.query, batch.key)
    expected = impl.forward(q_rot, k_rot, batch.value, ref_cache, batch.metadata)
    calls = []
    real = triton_attention.apply_rotary_write_kv

    def spy(*args):
        calls.append(len(args))
        return real(*args)

    monkeypatch.setattr(triton_attention, "apply_rotary_write_kv", spy)
    out = impl.forward_rotary(positions, rope, batch.query, batch.key, batch.value,
                              batch.kv_cache, batch.metadata)
    assert calls  # the one-launch path ran
    n = batch.num_real_tokens
    assert torch.equal(out[:n], expected[:n])
    assert torch.equal(batch.kv_cache, ref_cache)


@pytest.mark.parametrize("case", ["partial rotary", "fp8 cache", "switched off"])
def test_triton_forward_rotary_falls_back_where_the_kernel_does_not_apply(case, monkeypatch):
    """A partial rotation (no neox table), an fp8 cache and ``OCTAVO_ROTARY_CACHE_WRITE=0``
    take the default: rotate, then ``forward`` (which writes the cache with its own
    kernel)."""
    import octavo.kernels.triton.attention as triton_attention

    def refuse(*args):
        raise AssertionError("the one-launch kernel must not run here")

    monkeypatch.setattr(triton_attention, "apply_rotary_write_kv", refuse)
    batch = _paged(torch.float32, [1, 1], [5, 9])
    positions = _positions([1, 1], [5, 9], 1)
    rope = make_rope(64, partial=0.5 if case == "partial rotary" else 1.0)
    cache = batch.kv_cache
    if case == "fp8 cache":
        cache = cache.to(torch.float8_e4m3fn)
    if case == "switched off":
        monkeypatch.setenv("OCTAVO_ROTARY_CACHE_WRITE", "0")
    impl = TritonAttentionBackend(SMALL).make_impl(8, 2, 64, batch.scale)
    out = impl.forward_rotary(positions, rope, batch.query, batch.key, batch.value, cache,
                              batch.metadata)
    q_rot, k_rot = rope(positions, batch.query, batch.key)
    expected = impl.forward(q_rot, k_rot, batch.value, cache.clone(), batch.metadata)
    n = batch.num_real_tokens
    assert torch.equal(out[:n], expected[:n])


def test_default_forward_rotary_rotates_then_forwards():
    """The contract's default (every backend without a fused kernel, here the reference)."""
    batch = _paged(torch.float32, [2, 1], [6, 9])
    positions = _positions([2, 1], [6, 9], 1)
    rope = make_rope(64)
    impl = ReferenceAttentionImpl(8, 2, 64, batch.scale)
    ref_cache = batch.kv_cache.clone()
    q_rot, k_rot = rope(positions, batch.query, batch.key)
    expected = impl.forward(q_rot, k_rot, batch.value, ref_cache, batch.metadata)
    out = impl.forward_rotary(positions, rope, batch.query, batch.key, batch.value,
                              batch.kv_cache, batch.metadata)
    n = batch.num_real_tokens  # the padding row's output is not defined
    assert torch.equal(out[:n], expected[:n]) and torch.equal(batch.kv_cache, ref_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_one_launch_equals_two_at_llama3_8b_shapes_on_gpu(num_tokens):
    """Compiled (not interpreted): bit-identical query and cache at Llama-3-8B's heads, from
    one decode token to a prefill chunk, in bf16."""
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen).cuda()
    qkv = torch.randn(num_tokens, (32 + 16) * 128, generator=gen).to(torch.bfloat16).cuda()
    q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
    q, k, v = (t.view(num_tokens, -1, 128) for t in (q, k, v))
    slots = torch.randperm(8 * 1024, generator=gen)[:num_tokens].cuda()
    slots[0] = -1  # a padding token
    rope = RotaryEmbedding(128, MAX_POSITIONS, RopeParameters("default", 500000.0)).cuda()
    cache = torch.randn(2, 1024, 8, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    expected_cache = cache.clone()
    q_ref, k_ref = apply_rotary(positions, q, k, rope.cos_sin_cache)
    write_kv_cache(k_ref, v, expected_cache, slots)
    q_out = apply_rotary_write_kv(positions, q, k, v, rope.cos_sin_cache, cache, slots)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(cache, expected_cache)
