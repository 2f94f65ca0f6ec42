"""Rotary embedding: frequencies and rotation against transformers' own implementation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from octavo.model_executor.layers.rotary import (
    RopeParameters,
    RotaryEmbedding,
    attention_scaling,
    compute_inv_freq,
    get_rope,
    rope_parameters_from_config,
)
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

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
    config = SimpleNamespace(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"'mrope'.*default, linear, llama3, yarn, dynamic, longrope"):
        rope_parameters_from_config(config)


# ---- yarn, dynamic (NTK), longrope, partial rotary: against transformers' rope-init functions ---

YARN_CASES = {
    "qwen-like": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "deepseek-like": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    "explicit-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                                  "original_max_position_embeddings": 512, "beta_fast": 16,
                                  "truncate": False},
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_and_attention_factor_match_transformers(case: str) -> None:
    config = llama_config(dict(YARN_CASES[case]))
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = rope_parameters_from_config(config)
    assert params.rope_type == "yarn"
    torch.testing.assert_close(compute_inv_freq(128, params), expected, rtol=1e-6, atol=0)
    assert attention_scaling(params) == pytest.approx(expected_factor, rel=1e-12)
    assert attention_scaling(params) != 1.0


@pytest.mark.parametrize("max_model_len", [None, 1024, 3000])
def test_dynamic_ntk_frequencies_match_transformers(max_model_len: int | None) -> None:
    """Fixed per engine from max_model_len: transformers' frequencies for that length (the
    plain ones up to max_position_embeddings = 1024)."""
    config = llama_config({"rope_type": "dynamic", "factor": 2.0})
    params = rope_parameters_from_config(config, context_len=max_model_len)
    expected, factor = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=max_model_len)
    torch.testing.assert_close(compute_inv_freq(128, params), expected, rtol=1e-6, atol=0)
    assert attention_scaling(params) == factor == 1.0
    plain = compute_inv_freq(128, RopeParameters("default", 500000.0))
    assert torch.equal(compute_inv_freq(128, params), plain) == (max_model_len != 3000)


def phi3_config(rope_scaling: dict | None = None, **kwargs):
    from transformers import Phi3Config

    kwargs.setdefault("max_position_embeddings", 4096)
    kwargs.setdefault("original_max_position_embeddings", 512)
    return Phi3Config(hidden_size=256, num_attention_heads=4, rope_scaling=rope_scaling, **kwargs)


LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
            "long_factor": [1.5 + 0.3 * i for i in range(32)]}


@pytest.mark.parametrize("max_model_len", [None, 512, 4096])
def test_longrope_frequencies_match_transformers(max_model_len: int | None) -> None:
    """The long factors are used when max_model_len (default: max_position_embeddings) passes
    the original 512 positions; ``su`` (longrope's old name) reads the same."""
    config = phi3_config(dict(LONGROPE))
    old_name = SimpleNamespace(rope_scaling=dict(LONGROPE, type="su"), rope_theta=10000.0,
                               max_position_embeddings=4096,
                               original_max_position_embeddings=512)
    assert rope_parameters_from_config(old_name, context_len=max_model_len) == \
        rope_parameters_from_config(config, context_len=max_model_len)
    params = rope_parameters_from_config(config, context_len=max_model_len)
    assert params.rope_type == "longrope"
    long = (max_model_len or 4096) > 512
    seq_len = 513 if long else None
    expected, factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
    torch.testing.assert_close(compute_inv_freq(64, params), expected, rtol=1e-6, atol=0)
    assert attention_scaling(params) == pytest.approx(factor, rel=1e-12)
    assert factor > 1.0  # 4096 / 512 = 8: sqrt(1 + ln 8 / ln 512)


def test_partial_rotary_matches_transformers() -> None:
    """Phi-4-mini style: only the first 3/4 of each head is rotated (longrope, partial)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    config = phi3_config({"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(24)],
                          "long_factor": [2.0] * 24}, partial_rotary_factor=0.75)
    ours = get_rope(config, 64, max_model_len=512)
    assert ours.rotary_dim == 48 and ours.cos_sin_cache.shape == (4096, 48)
    hf_rope = Phi3RotaryEmbedding(config)
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 100, 511])
    query = torch.randn(4, 4, 64, generator=generator)
    key = torch.randn(4, 2, 64, generator=generator)
    q_ours, k_ours = ours(positions, query, key)
    cos, sin = hf_rope(query, positions[None])
    q_hf, k_hf = phi3_apply(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(q_ours[..., 48:], query[..., 48:])  # the pass-through part


def test_per_layer_type_parameters_gemma3() -> None:
    """Gemma 3: a local base for sliding layers, the global base and its scaling for the rest."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(
        hidden_size=64, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=6, max_position_embeddings=512, rope_local_base_freq=10000.0,
        rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    hf = Gemma3RotaryEmbedding(config)
    for layer_type in ("sliding_attention", "full_attention"):
        ours = get_rope(config, 32, layer_type=layer_type)
        torch.testing.assert_close(compute_inv_freq(32, ours.params),
                                   getattr(hf, f"{layer_type}_inv_freq"), rtol=1e-6, atol=0)
    local = rope_parameters_from_config(config, "sliding_attention")
    full = rope_parameters_from_config(config, "full_attention")
    assert (local.rope_type, local.theta) == ("default", 10000.0)
    assert (full.rope_type, full.theta, full.factor) == ("linear", 1e6, 8.0)
    with pytest.raises(ValueError, match="per layer type"):
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
