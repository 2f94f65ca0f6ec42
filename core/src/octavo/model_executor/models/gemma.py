"""Gemma 2 and Gemma 3 (text): the Llama body with Gemma's layers.

What differs from Llama (each as in Hugging Face's ``Gemma2*``/``Gemma3*`` modules):

- every RMSNorm is ``x / rms(x) * (1 + w)`` in float32 (``GemmaRMSNorm``), and each block has
  four of them: before and after attention, before and after the MLP (the "sandwich");
- the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype); a tied LM
  head reads the unscaled weight;
- the MLP is GELU-gated (``gelu_pytorch_tanh``);
- the softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- layers alternate between a sliding window and full attention (``config.layer_types``);
- Gemma 2 soft-caps attention scores (``attn_logit_softcapping``) and both soft-cap the final
  logits when ``final_logit_softcapping`` is set: ``cap * tanh(logits / cap)``;
- Gemma 3 normalises queries and keys per head (``q_norm``/``k_norm``, also ``(1 + w)``) and
  gives local and global layers their own rope parameters (``rope_parameters`` per layer type:
  base 10k on local layers, 1M, possibly linearly scaled, on global ones).

The residual stream is carried as in ``LlamaDecoderLayer`` (block output and residual kept
apart, the add fused into the next norm), so ``LlamaModel.forward``, tensor and pipeline
parallelism, weight loading and quantized linear layers (``quant_config``) are shared
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.config import attention_logit_soft_cap
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers import GeluAndMul, GemmaRMSNorm, RotaryEmbedding
from octavo.model_executor.layers.quantization.base import QuantizationConfig
from octavo.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    MakeMLP,
)

# transformers' activation names of the GELUs Gemma checkpoints use -> F.gelu's approximate.
_GELU_APPROXIMATIONS = {
    "gelu_pytorch_tanh": "tanh",
    "gelu_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu": "none",
}


def gemma_activation(config: Any) -> GeluAndMul:
    """The gated GELU of ``config.hidden_activation`` (older configs: ``hidden_act``)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    name = name or "gelu_pytorch_tanh"
    if name not in _GELU_APPROXIMATIONS:
        raise ValueError(f"Gemma MLP activation {name!r} is not supported; expected one of "
                         f"{sorted(_GELU_APPROXIMATIONS)}")
    return GeluAndMul(_GELU_APPROXIMATIONS[name])


class GemmaDecoderLayer(nn.Module):
    """One Gemma 2/3 block: ``h += post_attn_norm(attn(input_norm(h)))``, then
    ``h += post_ff_norm(mlp(pre_ff_norm(h)))``, the residual carried apart as in Llama."""

    def __init__(self, config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, parallel: ParallelState,
                 sliding_window: int | None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            config, options, rotary_emb, attn_backend, parallel, quant_config,
            f"{prefix}.self_attn", sliding_window=sliding_window,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            logits_soft_cap=attention_logit_soft_cap(config),
            norm_cls=GemmaRMSNorm,
        )
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, options.mlp_bias,
                            parallel, act=gemma_activation(config), quant_config=quant_config,
                            prefix=f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for the first layer
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(block output, residual)``; their sum is the stream after this layer."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class GemmaModel(LlamaModel):
    """Gemma's layers and final ``(1 + w)`` norm; the embedding scaled by ``sqrt(hidden)``.
    Its layers build their GELU MLP themselves (``make_mlp`` is not used)."""

    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, options: DecoderOptions, attn_backend: AttentionBackend,
                 parallel: ParallelState, make_mlp: MakeMLP | None = None,
                 quant_config: QuantizationConfig | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(config, options, attn_backend, parallel, make_mlp, quant_config,
                         max_model_len)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def make_layer(self, config: Any, index: int, options: DecoderOptions,
                   attn_backend: AttentionBackend, parallel: ParallelState) -> nn.Module:
        return GemmaDecoderLayer(config, options, self.rope_for(config, index), attn_backend,
                                 parallel, self.sliding_windows[index], self.quant_config,
                                 f"model.layers.{index}")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        assert self.embed_tokens is not None, "only the first pipeline stage embeds"
        hidden_states = self.embed_tokens(input_ids)
        # The scale is rounded to the model dtype first, as transformers does.
        return hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: sandwich norms, attention and final logit soft-capping, local/global layers."""

    model_cls = GemmaModel

    def __init__(self, config: Any, attn_backend: AttentionBackend,
                 parallel: ParallelState | None = None,
                 quant_config: QuantizationConfig | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(config, attn_backend, parallel, quant_config, max_model_len)
        cap = getattr(config, "final_logit_softcapping", None)
        # cap * tanh(logits / cap) on the final logits (None: none).
        self.final_logit_softcapping: float | None = float(cap) if cap else None

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)  # float32 [n, vocab_size]
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text only): Gemma 2 plus per-head q/k norms and rope per layer type; no
    attention soft cap (transformers' Gemma 3 ignores ``attn_logit_softcapping``)."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
