"""The sparse feed-forward block shared by the mixture-of-experts models.

``SparseMoeBlock``: a router (``gate``, replicated on every rank) scores the experts of each
token; the routed experts (``experts``, a ``FusedMoE``) run on its top-k; an optional shared
expert (Qwen2-MoE) runs on every token, scaled by ``sigmoid(shared_expert_gate(x))``. Split
over tensor-parallel ranks, the routed and shared experts each produce this rank's partial
sum, and one all-reduce sums both.

Checkpoint names under the block: ``gate.weight``, ``experts.<e>.<gate|up|down>.weight``
(Mixtral: ``w1``/``w3``/``w2``), ``shared_expert.{gate,up,down}_proj.weight``,
``shared_expert_gate.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers.fused_moe import FusedMoE
from octavo.model_executor.layers.linear import ReplicatedLinear
from octavo.model_executor.models.llama import LlamaMLP


class SparseMoeBlock(nn.Module):
    """``experts(x) [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]``.

    :param shared_intermediate_size: the shared expert's intermediate size (None: none).
    :param shared_expert_gate: scale the shared expert by a learned sigmoid gate.
    Other parameters as ``FusedMoE``'s.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        parallel: ParallelState,
        renormalize: bool,
        checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        routing_weights_in_model_dtype: bool = False,
        shared_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, parallel, renormalize,
            checkpoint_names, routing_weights_in_model_dtype, reduce_results=False)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(hidden_size, shared_intermediate_size, False, parallel,
                                          reduce_results=False)
            if shared_expert_gate:
                self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        router_logits = self.gate(x)  # [num_tokens, num_experts]
        out = self.experts(x, router_logits)  # this rank's part when split
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.parallel.tp_size > 1:
            out = self.parallel.all_reduce(out)
        return out


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Whether layer ``layer_index`` of a Qwen MoE model has experts: not listed in
    ``mlp_only_layers`` and on the ``decoder_sparse_step`` grid (the others are dense MLPs of
    ``intermediate_size``)."""
    if layer_index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return config.num_experts > 0 and (layer_index + 1) % step == 0


def check_silu(config: Any) -> None:
    """The experts are SiLU-gated MLPs; refuse another activation in one clear line."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{type(config).__name__}.hidden_act={act!r} is not supported by "
                         "Octavo's mixture-of-experts layers (only 'silu')")
