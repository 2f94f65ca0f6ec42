"""Mistral: the Llama decoder; its ``config.sliding_window`` applies to every layer."""

from __future__ import annotations

from octavo.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and maths as Llama. A set ``config.sliding_window`` (Mistral 7B v0.1:
    4096) makes every layer attend over that many positions (see
    ``octavo.config.layer_sliding_windows``); the engine runs it at full context length."""
