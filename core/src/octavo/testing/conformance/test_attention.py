"""The backend's attention kernels against the core's plain-torch reference.

Multi-step workloads (``octavo.testing.paged_steps``): prompts of many lengths, prefill chunks
after a cached prefix, decodes, all mixed in one step, and a prefix shared with a sequence that
fills it in the same step; scattered block tables padded with a block nobody writes; a cache
allocated full of NaN, as uninitialised memory may be. The cache is always written by the
backend itself (its own KV layout); when the layout is the default one, the written slots are
also compared with the reference's and every other slot must still be NaN.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from octavo.attention.reference import paged_attention_reference, write_kv_reference
from octavo.testing.compare import assert_kernel_close
from octavo.testing.paged_steps import build_workload, workload_cases

CASES = ("prefill-then-decode", "chunked-prefill", "mixed", "shared-prefix")
# Query heads per KV head: grouped-query attention (group 4) unless a test says otherwise.
NUM_HEADS, NUM_KV_HEADS = 8, 2
# Context length of the model the kernels are asked for (the workloads' longest is 602).
MAX_MODEL_LEN = 1024


def attention_backend(pm, plan, *, num_heads, num_kv_heads, head_dim, dtype, block_size):
    """The backend's ``octavo_attention_backend`` answer for a model of these dimensions."""
    from transformers import LlamaConfig

    from octavo.config import CacheConfig, ModelConfig

    hf_config = LlamaConfig(
        hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, num_hidden_layers=1,
        intermediate_size=4 * head_dim, vocab_size=384, max_position_embeddings=MAX_MODEL_LEN,
    )
    model_config = ModelConfig(
        model="octavo-conformance", gguf_file=None, model_dir=Path("."), hf_config=hf_config,
        dtype=getattr(torch, dtype), max_model_len=MAX_MODEL_LEN,
    )
    attn = pm.hook.octavo_attention_backend(
        backend=plan.backend, model_config=model_config,
        cache_config=CacheConfig(block_size=block_size),
    )
    assert attn is not None, f"octavo_attention_backend returned None for {plan.backend!r}"
    supported = attn.supported_head_dims()
    assert supported is None or head_dim in supported, (
        f"the capabilities of {plan.backend!r} allow head dim {head_dim}, but its attention "
        f"backend {attn.name!r} supports only {supported}"
    )
    return attn


def step_positions(metadata) -> torch.Tensor:
    """Each new token's position in its sequence (padding rows: 0)."""
    starts = metadata.query_start_loc.tolist()
    positions = torch.zeros(metadata.slot_mapping.shape[0], dtype=torch.int64)
    for seq, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        positions[start:end] = torch.arange(seq_len - (end - start), seq_len)
    return positions


def run_workload(pm, plan, device, case, *, dtype, head_dim, block_size,
                 num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, rotary=False):
    """Run every step of ``case`` on the backend and on the reference; compare each step.

    ``rotary``: through ``AttentionImpl.forward_rotary`` (which a backend may fuse with its
    cache write) with a default RoPE, against the reference rotating in float32 first; then
    only the outputs are compared (the backend rotates in its dtype)."""
    from octavo.model_executor.layers import RopeParameters, RotaryEmbedding

    ropes = [RotaryEmbedding(head_dim, MAX_MODEL_LEN, RopeParameters("default", 10000.0))
             for _ in range(2)]
    rope_ref, rope = ropes[0], ropes[1].to(device)
    torch_dtype = getattr(torch, dtype)
    workload = build_workload(
        workload_cases(block_size)[case], block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch_dtype,
    )
    attn = attention_backend(pm, plan, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, block_size=block_size)
    scale = head_dim**-0.5
    impl = attn.make_impl(num_heads, num_kv_heads, head_dim, scale)
    default_shape = (2, workload.num_blocks, block_size, num_kv_heads, head_dim)
    shape = tuple(attn.get_kv_cache_shape(workload.num_blocks, block_size, num_kv_heads, head_dim))
    kv_cache = torch.full(shape, float("nan"), dtype=torch_dtype, device=device)
    ref_cache = torch.full(default_shape, float("nan"), dtype=torch.float32)
    for index, step in enumerate(workload.steps):
        what = f"{case} step {index} ({dtype}, head_dim {head_dim}, block_size {block_size})"
        inputs = (step.query.to(device, torch_dtype), step.key.to(device, torch_dtype),
                  step.value.to(device, torch_dtype), kv_cache, step.metadata_on(device))
        query, key = step.query, step.key
        if rotary:
            positions = step_positions(step.metadata)
            out = impl.forward_rotary(positions.to(device), rope, *inputs)
            query, key = rope_ref.forward_native(positions, query, key)
        else:
            out = impl.forward(*inputs)
        write_kv_reference(key, step.value, ref_cache, step.metadata.slot_mapping)
        expected = paged_attention_reference(query, ref_cache, step.metadata, scale)
        assert out.shape == expected.shape, f"{what}: output shape {tuple(out.shape)}"
        assert out.dtype == torch_dtype, f"{what}: output dtype {out.dtype}, expected {dtype}"
        assert out.device.type == device.type, f"{what}: output on {out.device}"
        assert_kernel_close(out, expected, dtype, what)
    if shape == default_shape and not rotary:
        # The cache holds exactly the (rounded) K/V at the written slots and NaN elsewhere.
        torch.testing.assert_close(
            kv_cache.to("cpu", torch.float32), ref_cache, equal_nan=True, atol=0, rtol=0,
            msg=lambda m: f"{case}: KV cache after the workload differs from the reference: {m}",
        )


@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_reference(
    octavo_pm, octavo_plan, octavo_device, case,
    octavo_kernel_dtype, octavo_kernel_head_dim, octavo_kernel_block_size,
):
    run_workload(octavo_pm, octavo_plan, octavo_device, case, dtype=octavo_kernel_dtype,
                 head_dim=octavo_kernel_head_dim, block_size=octavo_kernel_block_size)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["multi-head", "multi-query"])
def test_head_layouts(octavo_pm, octavo_plan, octavo_device, heads):
    """Other query/KV head ratios than the grouped-query default (plan's first dtype and sizes)."""
    num_heads, num_kv_heads = heads
    run_workload(octavo_pm, octavo_plan, octavo_device, "mixed",
                 dtype=octavo_plan.kernel_dtypes[0], head_dim=octavo_plan.kernel_head_dims[0],
                 block_size=octavo_plan.kernel_block_sizes[0], num_heads=num_heads,
                 num_kv_heads=num_kv_heads)


def test_rotation_then_attention(octavo_pm, octavo_plan, octavo_device):
    """``forward_rotary`` (the rotation, which a backend may fuse with its cache write, then
    attention) against rotating in float32 and the reference attention: the mixed workload,
    plan's first dtype and sizes."""
    run_workload(octavo_pm, octavo_plan, octavo_device, "mixed",
                 dtype=octavo_plan.kernel_dtypes[0], head_dim=octavo_plan.kernel_head_dims[0],
                 block_size=octavo_plan.kernel_block_sizes[0], rotary=True)
