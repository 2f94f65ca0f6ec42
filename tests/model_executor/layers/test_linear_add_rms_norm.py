"""``ColumnParallelLinear.forward_add_rms_norm``: when a linear method may take the RMS norm
before the layer into its kernel (``LinearMethod.apply_add_rms_norm``), and what it is given.
The decoder layer end to end: ``tests/model_executor/quantization/test_quantized_models.py``."""

from __future__ import annotations

import torch
from octavo.model_executor.layers.linear import ColumnParallelLinear, OutputShard
from octavo.model_executor.layers.rmsnorm import GemmaRMSNorm, RMSNorm


class RecordingMethod:
    """Stands in for a quantization method with a fused norm: records what it is asked."""

    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def apply_add_rms_norm(self, layer, x, residual, norm_weight, eps, bias):
        self.asked.append((x, residual, norm_weight, eps, bias))
        return "out", "new residual"


def make_layer(bias: bool = False) -> ColumnParallelLinear:
    return ColumnParallelLinear(16, [OutputShard(None, 0, 8, 8)], bias)


def test_a_plain_rms_norm_goes_to_the_method_with_its_weight_eps_and_the_bias():
    layer = make_layer(bias=True)
    layer.quant_method = method = RecordingMethod()
    norm = RMSNorm(16, eps=1e-5)
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    assert layer.forward_add_rms_norm(x, residual, norm) == ("out", "new residual")
    (got_x, got_residual, weight, eps, bias), = method.asked
    assert got_x is x and got_residual is residual and weight is norm.weight
    assert eps == 1e-5 and bias is layer.bias


def test_no_fused_norm_for_other_norms_lora_or_methods_without_one():
    x, residual = torch.randn(1, 16), torch.randn(1, 16)
    layer = make_layer()
    layer.quant_method = method = RecordingMethod()
    assert layer.forward_add_rms_norm(x, residual, GemmaRMSNorm(16)) is None  # 1 + weight
    layer.lora = object()  # adapters read the normed input
    assert layer.forward_add_rms_norm(x, residual, RMSNorm(16)) is None
    assert method.asked == []
    # dense weights: the base method has none, the caller runs the norm
    assert make_layer().forward_add_rms_norm(x, residual, RMSNorm(16)) is None
