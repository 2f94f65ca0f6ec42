"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (per-head q/k RMSNorm) with
sparse experts and no shared expert.

Softmax routing over ``num_experts``; the ``num_experts_per_tok`` best, renormalised when
``norm_topk_prob`` (on in the released checkpoints), rounded to the model dtype. Layers in
``mlp_only_layers`` or off the ``decoder_sparse_step`` grid are dense MLPs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.models.llama import make_llama_mlp
from octavo.model_executor.models.moe import SparseMoeBlock, check_silu, is_sparse_layer
from octavo.model_executor.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """``q_norm``/``k_norm`` on; attention biases per ``config.attention_bias``."""

    def make_mlp(self, config: Any, layer_index: int, parallel: ParallelState) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return make_llama_mlp(config, self.options, parallel, self.quant_config,
                                  f"model.layers.{layer_index}.mlp")
        check_silu(config)
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, parallel,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            routing_weights_in_model_dtype=True)
