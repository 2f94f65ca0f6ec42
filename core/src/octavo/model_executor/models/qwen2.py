"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from octavo.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


def qwen_sliding_window(config: Any) -> int | None:
    """Qwen configs carry a ``sliding_window`` that only counts when ``use_sliding_window``."""
    if not getattr(config, "use_sliding_window", False):
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Q/K/V projections always have biases; the output projection and MLP never do."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)

    @classmethod
    def sliding_window_of(cls, config: Any) -> int | None:
        return qwen_sliding_window(config)
