"""Qwen3: the Llama decoder with per-head RMSNorm of queries and keys before rope.

Its config gives ``head_dim`` explicitly (it need not be ``hidden_size / num_heads``); the
shared decoder already reads it.
"""

from __future__ import annotations

from typing import Any

from octavo.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``q_norm``/``k_norm`` on; attention biases (q/k/v/o) follow ``config.attention_bias``."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
