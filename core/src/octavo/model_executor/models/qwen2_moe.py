"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder with sparse experts plus a
shared expert.

Softmax routing over ``num_experts``; the ``num_experts_per_tok`` best, renormalised only when
``norm_topk_prob`` (off by default), rounded to the model dtype. Every token also runs the
shared expert (``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``.
Layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid are dense MLPs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.models.llama import DecoderOptions, LlamaForCausalLM, make_llama_mlp
from octavo.model_executor.models.moe import SparseMoeBlock, check_silu, is_sparse_layer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Q/K/V biases per ``config.qkv_bias`` (default on); no output-projection bias. Its
    ``sliding_window`` counts as Qwen2's (``octavo.config.layer_sliding_windows``)."""

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    def make_mlp(self, config: Any, layer_index: int, parallel: ParallelState) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return make_llama_mlp(config, self.options, parallel, self.quant_config,
                                  f"model.layers.{layer_index}.mlp")
        check_silu(config)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, parallel,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            routing_weights_in_model_dtype=True,
            shared_intermediate_size=config.shared_expert_intermediate_size,
            shared_expert_gate=True)
