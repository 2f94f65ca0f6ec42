"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from octavo.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Q/K/V projections always have biases; the output projection and MLP never do.

    Its ``sliding_window`` counts only with ``use_sliding_window``, on the layers from
    ``max_window_layers`` on (``config.layer_types``; see ``octavo.config.layer_sliding_windows``).
    """

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
