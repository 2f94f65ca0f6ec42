"""Rotary embedding: frequencies and rotation against transformers' own implementation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from octavo.model_executor.layers.rotary import (
    RopeParameters,
    RotaryEmbedding,
    compute_inv_freq,
    get_rope,
    rope_parameters_from_config,
)

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_config(rope: dict | None, **kwargs) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=1024, num_attention_heads=8, max_position_embeddings=1024,
        rope_scaling=rope, rope_theta=500000.0, **kwargs,
    )


def test_llama3_frequencies_match_transformers() -> None:
    config = llama_config(dict(LLAMA31_ROPE))
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    params = rope_parameters_from_config(config)
    assert params == RopeParameters("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    ours = compute_inv_freq(128, params)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert attention_factor == 1.0
    # All three bands occur: kept (high freq), divided by factor (low freq), blended between.
    plain = compute_inv_freq(128, RopeParameters("default", 500000.0))
    ratio = plain / ours
    assert bool((ratio == 1).any()) and bool((ratio == 8).any())
    assert bool(((ratio > 1.001) & (ratio < 7.999)).any())


def test_linear_and_default_frequencies_match_transformers() -> None:
    linear = llama_config({"rope_type": "linear", "factor": 4.0})
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](linear)
    torch.testing.assert_close(compute_inv_freq(128, rope_parameters_from_config(linear)), expected)
    default = llama_config(None)
    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(default)
    params = rope_parameters_from_config(default)
    assert params.rope_type == "default" and params.theta == 500000.0
    torch.testing.assert_close(compute_inv_freq(128, params), expected)


def test_old_style_config_is_read() -> None:
    config = SimpleNamespace(
        rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}, max_position_embeddings=64
    )
    assert rope_parameters_from_config(config) == RopeParameters("linear", 1e6, factor=2.0)
    plain = SimpleNamespace(rope_theta=None, max_position_embeddings=64)
    assert rope_parameters_from_config(plain) == RopeParameters("default", 10000.0)


def test_unsupported_rope_type_is_named() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match=r"'yarn'.*default, linear, llama3"):
        rope_parameters_from_config(config)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}, LLAMA31_ROPE])
def test_rotation_matches_transformers(rope: dict | None) -> None:
    config = llama_config(dict(rope) if rope else None, head_dim=64)
    hf_rope = LlamaRotaryEmbedding(config)
    ours = get_rope(config, 64)
    assert isinstance(ours, RotaryEmbedding) and ours.max_positions == 1024
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 77, 512, 1023])
    query = torch.randn(6, 8, 64, generator=generator)  # [num_tokens, num_heads, head_dim]
    key = torch.randn(6, 2, 64, generator=generator)  # [num_tokens, num_kv_heads, head_dim]
    q_ours, k_ours = ours(positions, query, key)
    cos, sin = hf_rope(query, positions[None])  # [1, num_tokens, head_dim]
    q_hf, k_hf = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin, unsqueeze_dim=1
    )
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert math.isclose(float(q_ours.norm()), float(query.norm()), rel_tol=1e-5)  # a rotation
