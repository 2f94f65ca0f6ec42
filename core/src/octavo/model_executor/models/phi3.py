"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama decoder with fused checkpoint tensors.

The maths is Llama's. The checkpoints store Q/K/V as one ``qkv_proj`` tensor (rows: all query
heads, then key heads, then value heads) and gate/up as one ``gate_up_proj`` (gate rows, then
up rows): ``load_hf_weights`` hands each fused tensor to the merged layer of the same name,
whose loader takes every rank's slice of each shard out of it. Long-context variants use
``longrope`` (old name ``su``) and Phi-4-mini a partial rotary factor, both through
``octavo.model_executor.layers.rotary``; a ``sliding_window`` in the config (Phi-3-mini: 2047)
applies to every layer.
"""

from __future__ import annotations

from typing import Any

from octavo.model_executor.models.llama import DecoderOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """No biases anywhere; everything else follows the config like Llama."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions()
