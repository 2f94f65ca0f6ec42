"""An MLP's merged gate/up projection and SiLU-and-mul as one kernel
(``ColumnParallelLinear.forward_silu_and_mul``, ``LinearMethod.apply_silu_and_mul``): which
layers take it, and that ``LlamaMLP`` gives the same result either way. The kernel itself is
tested in ``tests/kernels/test_triton_dense_gemv.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from octavo.distributed.parallel_state import ParallelRanks, ParallelState
from octavo.kernels.dense import dense_silu_and_mul
from octavo.model_executor.layers import GeluAndMul
from octavo.model_executor.models.llama import LlamaMLP


def mlp(act=None) -> LlamaMLP:
    torch.manual_seed(0)
    layer = LlamaMLP(16, 24, bias=False, parallel=ParallelState(ParallelRanks(0, 1, 1)), act=act)
    for param in layer.parameters():
        param.data.normal_(0, 0.1)
    return layer


def reference(layer: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, layer.gate_up_proj.weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, layer.down_proj.weight)


class Fused:
    """Stands in for a method with a gated kernel: records its calls, answers ``value``."""

    def __init__(self, method, value: torch.Tensor) -> None:
        self.method, self.value, self.calls = method, value, 0

    def apply(self, layer, x, bias):
        return self.method.apply(layer, x, bias)

    def apply_silu_and_mul(self, layer, x, bias):
        self.calls += 1
        return self.value


def test_without_a_gated_kernel_the_mlp_runs_projection_then_activation():
    layer, x = mlp(), torch.randn(1, 16)
    assert layer.fuse_silu
    assert layer.gate_up_proj.forward_silu_and_mul(x) is None  # the CPU: no such kernel
    assert dense_silu_and_mul(x, layer.gate_up_proj.weight, None) is None
    torch.testing.assert_close(layer(x), reference(layer, x))


def test_a_methods_gated_result_goes_straight_to_the_down_projection():
    layer, x = mlp(), torch.randn(1, 16)
    gate, up = F.linear(x, layer.gate_up_proj.weight).chunk(2, dim=-1)
    fused = Fused(layer.gate_up_proj.quant_method, F.silu(gate) * up)
    layer.gate_up_proj.quant_method = fused
    torch.testing.assert_close(layer(x), reference(layer, x))
    assert fused.calls == 1


def test_no_gated_kernel_with_a_lora_adapter_or_another_activation():
    layer, x = mlp(), torch.randn(1, 16)
    fused = Fused(layer.gate_up_proj.quant_method, torch.full((1, 24), float("nan")))
    layer.gate_up_proj.quant_method = fused
    layer.gate_up_proj.lora = torch.nn.Identity()  # an adapter adds to the projection
    assert layer.gate_up_proj.forward_silu_and_mul(x) is None and fused.calls == 0

    gelu = mlp(act=GeluAndMul())
    assert not gelu.fuse_silu
    gelu.gate_up_proj.quant_method = Fused(gelu.gate_up_proj.quant_method,
                                           torch.full((1, 24), float("nan")))
    assert not torch.isnan(gelu(x)).any()
    assert gelu.gate_up_proj.quant_method.calls == 0
