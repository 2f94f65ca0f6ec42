"""``octavo.kernels.int4.int4_linear``'s seam for a backend's kernel (``octavo_quant_kernels``
-> ``int4_matmul``), and the int4 methods passing their kernels to it."""

from __future__ import annotations

import torch
from octavo.kernels.int4 import int4_linear, int4_linear_reference, pack_rows, quantize_int4
from octavo.model_executor.layers.quantization.base import QuantizationSource
from octavo.model_executor.layers.quantization.int4 import AWQConfig, GPTQConfig
from torch import nn


def int4_operands(n: int = 32, k: int = 256, group_size: int = 128):
    gen = torch.Generator().manual_seed(0)
    values, scales, zeros = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, group_size,
                                          False, None)
    return pack_rows(values), scales.half(), zeros.half()


class RecordingKernels:
    """A backend's kernels: takes the calls of ``take`` rows, declines the others."""

    def __init__(self, take: int) -> None:
        self.take = take
        self.calls: list[tuple[int, int]] = []

    def int4_matmul(self, x, qweight, scales, zeros, group_size, g_idx):
        self.calls.append((x.shape[0], group_size))
        if x.shape[0] != self.take:
            return None
        return torch.full((x.shape[0], qweight.shape[1]), 7.0, dtype=x.dtype)


def test_a_backend_kernel_takes_the_calls_it_accepts_and_leaves_the_rest():
    qweight, scales, zeros = int4_operands()
    bias = torch.arange(32, dtype=torch.float32)
    kernels = RecordingKernels(take=1)
    taken = int4_linear(torch.randn(1, 256), qweight, scales, zeros, 128, None, bias, kernels)
    assert torch.equal(taken, torch.full((1, 32), 7.0) + bias)  # the bias added after it
    x = torch.randn(3, 256)
    declined = int4_linear(x, qweight, scales, zeros, 128, None, bias, kernels)
    torch.testing.assert_close(declined,
                               int4_linear_reference(x, qweight, scales, zeros, 128, None, bias))
    assert kernels.calls == [(1, 128), (3, 128)]
    # kernels without int4_matmul (another method's) change nothing
    assert torch.equal(int4_linear(x, qweight, scales, zeros, 128, None, None, object()),
                       int4_linear_reference(x, qweight, scales, zeros, 128))


def test_gptq_and_awq_layers_hand_their_backend_kernels_to_the_matmul():
    qweight, scales, zeros = int4_operands()
    for config in (GPTQConfig.from_source(QuantizationSource({"bits": 4, "group_size": 128})),
                   AWQConfig.from_source(QuantizationSource({"bits": 4, "group_size": 128,
                                                             "version": "gemm"}))):
        config.kernels = RecordingKernels(take=2)
        method = config.linear_method("model.layers.0.mlp.down_proj", ())
        layer = nn.Module()
        layer.qweight, layer.scales, layer.zeros = qweight, scales, zeros
        layer.int4_group_size, layer.int4_g_idx = 128, None
        out = method.apply(layer, torch.randn(2, 256), None)
        assert torch.equal(out, torch.full((2, 32), 7.0))
        assert config.kernels.calls == [(2, 128)]
