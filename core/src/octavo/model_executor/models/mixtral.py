"""Mixtral: the Mistral decoder with a sparse mixture of experts in every layer.

Softmax routing over ``num_local_experts`` experts, the ``num_experts_per_tok`` best kept and
renormalised to sum to 1 (always), in float32. The checkpoint names the block
``block_sparse_moe`` and each expert's gate/up/down projections ``w1``/``w3``/``w2``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers.weights import Loaded
from octavo.model_executor.models.mistral import MistralForCausalLM
from octavo.model_executor.models.moe import SparseMoeBlock, check_silu


class MixtralForCausalLM(MistralForCausalLM):
    """Every decoder layer's MLP is a ``SparseMoeBlock`` (stored as ``mlp``)."""

    def make_mlp(self, config: Any, layer_index: int, parallel: ParallelState) -> nn.Module:
        check_silu(config)
        return SparseMoeBlock(
            config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size, parallel, renormalize=True,
            checkpoint_names=("w1", "w3", "w2"))

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """As ``LlamaForCausalLM.load_weights``, with ``block_sparse_moe`` read as ``mlp``."""
        super().load_weights(
            (name.replace(".block_sparse_moe.", ".mlp.", 1), tensor) for name, tensor in weights)
