"""A SiLU-gated MLP's down projection that computes ``silu(gate) * up`` as it loads its inputs
(``RowParallelLinear.forward_after_silu_and_mul``, ``LinearMethod.apply_after_silu_and_mul``):
the MLP takes that path where the method has such a kernel and answers as the activation then
the projection would; elsewhere (the CPU, LoRA adapters, other activations) it runs both."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers import GeluAndMul, SiluAndMul
from octavo.model_executor.layers.quantization.base import UnquantizedLinearMethod
from octavo.model_executor.models.llama import LlamaMLP


def mlp(act=None, bias: bool = False) -> LlamaMLP:
    torch.manual_seed(0)
    layer = LlamaMLP(16, 24, bias, ParallelState.single(), act=act)
    for param in layer.parameters():
        param.data.normal_(0.0, 0.2)
    return layer


def test_the_mlp_runs_the_activation_and_the_projection_where_no_kernel_does_both():
    layer = mlp(bias=True)
    x = torch.randn(3, 16)
    gate_up = F.linear(x, layer.gate_up_proj.weight, layer.gate_up_proj.bias)
    expected = F.linear(SiluAndMul().forward_native(gate_up), layer.down_proj.weight,
                        layer.down_proj.bias)
    assert layer.down_proj.forward_after_silu_and_mul(gate_up) is None  # the CPU: no kernel
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_the_mlp_takes_a_methods_gated_kernel_with_the_bias_of_one_rank(monkeypatch):
    calls = []

    def gated(self, layer, gate_up, bias):  # what a kernel computes, in one call
        calls.append(bias)
        return F.linear(SiluAndMul().forward_native(gate_up), layer.weight, bias) + 1000.0

    monkeypatch.setattr(UnquantizedLinearMethod, "apply_after_silu_and_mul", gated)
    layer = mlp(bias=True)
    x = torch.randn(2, 16)
    gate_up = F.linear(x, layer.gate_up_proj.weight, layer.gate_up_proj.bias)
    plain = F.linear(SiluAndMul().forward_native(gate_up), layer.down_proj.weight,
                     layer.down_proj.bias)
    assert torch.allclose(layer(x), plain + 1000.0, atol=1e-4)  # the kernel's answer
    assert len(calls) == 1 and calls[0] is layer.down_proj.bias  # one rank: bias fused
    # Another activation (Gemma's GELU) or a LoRA adapter on the projection: both run
    gelu = mlp(act=GeluAndMul())
    gelu(x)
    assert len(calls) == 1
    layer.down_proj.lora = object()
    assert layer.down_proj.forward_after_silu_and_mul(gate_up) is None
