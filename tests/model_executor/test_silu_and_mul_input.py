"""The MLP's activation inside the down projection's kernel (``LinearMethod.apply_silu_and_mul``,
``RowParallelLinear.forward_silu_and_mul``): asked for where a method has it, the unfused
path everywhere else, the same output either way. The fp8 kernel itself is checked in
``tests/kernels/test_triton_skinny_gemm.py``; on a GPU in ``backends/cuda/tests``."""

from __future__ import annotations

import torch
from octavo.distributed.parallel_state import ParallelState
from octavo.kernels import fp8 as fp8_kernels
from octavo.kernels.fp8 import FP8_DTYPE, fp8_linear_silu_and_mul
from octavo.model_executor.layers import GeluAndMul, SiluAndMul
from octavo.model_executor.layers.quantization.base import UnquantizedLinearMethod
from octavo.model_executor.models.llama import LlamaMLP


class FusingMethod(UnquantizedLinearMethod):
    """A dense method with a fused input: counts the calls, declines when ``take`` is off."""

    def __init__(self) -> None:
        self.take = True
        self.calls = 0

    def apply_silu_and_mul(self, layer, gate_up, bias):
        self.calls += 1
        if not self.take:
            return None
        return self.apply(layer, SiluAndMul()(gate_up), bias)  # what the MLP would run


class NoLoRA:
    def add_to(self, x, out):  # adapters that add nothing
        pass


def _mlp(act=None) -> LlamaMLP:
    torch.manual_seed(0)
    mlp = LlamaMLP(16, 32, False, ParallelState.single(), act=act)
    for param in mlp.parameters():
        param.data.normal_(0.0, 0.2)
    return mlp


def test_the_mlp_hands_the_activation_to_a_down_projection_that_takes_it():
    mlp = _mlp()
    x = torch.randn(3, 16)
    expected = mlp.down_proj(mlp.act(mlp.gate_up_proj(x)))
    # dense weights have no fused kernel: the unfused path, as before
    assert mlp.down_proj.quant_method.apply_silu_and_mul(mlp.down_proj, x, None) is None
    assert torch.equal(mlp(x), expected)
    method = FusingMethod()
    mlp.down_proj.quant_method = method
    assert torch.equal(mlp(x), expected) and method.calls == 1
    method.take = False  # declined for these operands: SiluAndMul, then apply
    assert torch.equal(mlp(x), expected) and method.calls == 2
    mlp.down_proj.lora = NoLoRA()  # adapters read the activation: never fused
    assert torch.equal(mlp(x), expected) and method.calls == 2


def test_other_activations_are_never_fused():
    mlp = _mlp(act=GeluAndMul())
    method = FusingMethod()
    mlp.down_proj.quant_method = method
    x = torch.randn(2, 16)
    assert torch.equal(mlp(x), mlp.down_proj(mlp.act(mlp.gate_up_proj(x))))
    assert method.calls == 0


def test_fp8_fuses_only_one_row_on_a_gpu_with_the_switch_on(monkeypatch):
    weight = torch.randn(8, 16).to(FP8_DTYPE)
    scale = torch.ones(8)
    gate_up = torch.randn(1, 32)
    monkeypatch.setattr(fp8_kernels, "fused_silu_down", lambda: True)
    assert fp8_linear_silu_and_mul(gate_up, weight, scale, None) is None  # the CPU
    monkeypatch.setattr(fp8_kernels, "scaled_mm_supported", lambda x, w: True)
    assert fp8_linear_silu_and_mul(torch.randn(2, 32), weight, scale, None) is None  # 2 rows
    assert fp8_linear_silu_and_mul(gate_up, weight, scale, None, (128, 128)) is None  # blocks
    monkeypatch.setattr(fp8_kernels, "fused_silu_down", lambda: False)
    assert fp8_linear_silu_and_mul(gate_up, weight, scale, None) is None  # switched off
