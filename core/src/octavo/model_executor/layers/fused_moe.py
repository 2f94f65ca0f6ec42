"""Mixture-of-experts feed-forward: routing, the experts of one layer, and their three paths.

``FusedMoE`` holds every expert's weights of one layer stacked: ``w13_weight [E, 2I, H]`` (each
expert's gate rows, then its up rows) and ``w2_weight [E, H, I]``. With tensor parallelism each
rank holds every expert's slice of the intermediate dimension, ``I / tp`` (gate/up split by
rows like a column-parallel layer, down by columns like a row-parallel one), and one
all-reduce after the down projection sums the ranks' parts. Checkpoints store one tensor per
expert and projection (``experts.<e>.gate_proj.weight``); ``checkpoint_weights`` tells
``load_hf_weights`` where each goes, and the loaders read only this rank's part.

The computation (``fused_moe_reference`` is the specification):

    out[t] = sum_j weight[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
    e = topk_ids[t, j]

three ways, chosen by ``FusedMoE.forward``:

- CUDA tensors (NVIDIA and ROCm builds of torch) with Triton importable: the fused kernel
  ``octavo.kernels.triton.fused_moe`` (tokens grouped by expert, two grouped GEMMs);
- otherwise ``fused_moe_native``: vectorised torch (assignments sorted by expert, one matmul
  pair per expert that received tokens, one scatter back), the CPU path;
- ``fused_moe_reference``: a plain loop in float32, for tests only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.distributed.parallel_state import ParallelState, divide
from octavo.kernels.triton_support import optional_triton_kernels
from octavo.model_executor.layers.weights import Loaded, copy_checked, narrow, set_weight_loader


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [num_tokens, top_k], int64 [num_tokens, top_k]
    """Softmax routing: the ``top_k`` most probable experts of each token and their softmax
    probabilities (float32), rescaled to sum to 1 when ``renormalize`` (Mixtral always;
    Qwen MoE when ``norm_topk_prob``). Ties are broken as ``torch.topk`` breaks them, as in the
    Hugging Face implementations."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden] float32
    """The specification: every expert in turn, on the tokens routed to it, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    intermediate = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        rows = x[tokens].float()  # [n, hidden]
        gate = rows @ w13[expert, :intermediate].float().T  # [n, intermediate]
        up = rows @ w13[expert, intermediate:].float().T
        down = (F.silu(gate) * up) @ w2[expert].float().T  # [n, hidden]
        out.index_add_(0, tokens, topk_weights[tokens, slots].float()[:, None] * down)
    return out


def fused_moe_native(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """Vectorised torch with the Triton kernel's roundings: the ``T * top_k`` assignments are
    sorted by expert, each expert that received any runs two matmuls on its contiguous rows,
    the weighted rows go back to assignment order and each token's top-k sum in float32.

    Synchronises with the device once (the per-expert counts), so it is the CPU path.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    intermediate = w13.shape[1] // 2
    flat_ids = topk_ids.flatten()  # [A]
    order = torch.argsort(flat_ids, stable=True)  # [A] assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, order // top_k)  # [A, hidden], expert by expert
    down = torch.empty_like(rows)  # [A, hidden]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        segment = rows[start:start + count]
        gate_up = F.linear(segment, w13[expert])  # [count, 2 * intermediate]
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down[start:start + count] = F.linear(act, w2[expert])
        start += count
    weights = topk_weights.flatten()[order].float()  # [A]
    weighted = (down.float() * weights[:, None]).to(x.dtype)
    out = torch.empty_like(weighted)
    out[order] = weighted  # back to assignment order: [num_tokens * top_k, hidden]
    return out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


class FusedMoE(nn.Module):
    """The routed experts of one layer (SiLU-gated MLPs), stacked and split over TP ranks.

    ``forward(x, router_logits)`` routes each token to its ``top_k`` experts
    (``select_experts``) and returns their weighted sum; with ``reduce_results=False`` a split
    layer returns this rank's partial sum (the caller all-reduces, e.g. after adding a shared
    expert's partial output).

    :param checkpoint_names: the checkpoint's names of each expert's gate, up and down
        projections (``("w1", "w3", "w2")`` for Mixtral).
    :param routing_weights_in_model_dtype: round the routing weights to the activations' dtype
        before use (what Qwen MoE checkpoints' reference code does; Mixtral keeps float32).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelState,
        renormalize: bool,
        checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        routing_weights_in_model_dtype: bool = False,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.routing_weights_in_model_dtype = routing_weights_in_model_dtype
        self.reduce_results = reduce_results
        self.parallel = parallel
        self.hidden_size = hidden_size
        self.local_intermediate = divide(intermediate_size, parallel.tp_size,
                                         "the experts' intermediate size")
        self.checkpoint_names = checkpoint_names
        local = self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local),
                                      requires_grad=False)
        set_weight_loader(self.w13_weight, self._load_w13)
        set_weight_loader(self.w2_weight, self._load_w2)

    def checkpoint_weights(self) -> dict[str, tuple[str, str]]:
        """Checkpoint names relative to this module -> (parameter, shard): one per expert and
        projection, e.g. ``"3.gate_proj.weight" -> ("w13_weight", "3.gate_proj")``."""
        gate, up, down = self.checkpoint_names
        names = {}
        for expert in range(self.num_experts):
            for proj, param in ((gate, "w13_weight"), (up, "w13_weight"), (down, "w2_weight")):
                names[f"{expert}.{proj}.weight"] = (param, f"{expert}.{proj}")
        return names

    def _expert_and_projection(self, shard: str | None) -> tuple[int, str]:
        expert, _, proj = (shard or "").partition(".")
        if not expert.isdigit() or int(expert) >= self.num_experts or proj not in (
                self.checkpoint_names):
            raise ValueError(f"no expert weight {shard!r} in a layer of {self.num_experts} "
                             f"experts with projections {self.checkpoint_names}")
        return int(expert), proj

    def _load_w13(self, param: nn.Parameter, loaded: Loaded, shard: str | None) -> None:
        """An expert's gate or up projection ``[I, H]``: this rank's rows of it."""
        expert, proj = self._expert_and_projection(shard)
        local = self.local_intermediate
        start = self.parallel.tp_rank * local
        offset = 0 if proj == self.checkpoint_names[0] else local
        with torch.no_grad():
            copy_checked(param.data[expert].narrow(0, offset, local),
                         narrow(loaded, 0, start, local),
                         f"{shard} rows {start}..{start + local}")

    def _load_w2(self, param: nn.Parameter, loaded: Loaded, shard: str | None) -> None:
        """An expert's down projection ``[H, I]``: this rank's columns of it."""
        expert, _ = self._expert_and_projection(shard)
        local = self.local_intermediate
        start = self.parallel.tp_rank * local
        with torch.no_grad():
            copy_checked(param.data[expert], narrow(loaded, 1, start, local),
                         f"{shard} columns {start}..{start + local}")

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.routing_weights_in_model_dtype:
            topk_weights = topk_weights.to(x.dtype)
        kernels = optional_triton_kernels("fused_moe") if x.is_cuda else None
        if kernels is None:
            out = fused_moe_native(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            out = kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.reduce_results and self.parallel.tp_size > 1:
            out = self.parallel.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate (local)={self.local_intermediate}, renormalize={self.renormalize}")
