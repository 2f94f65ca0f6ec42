"""``octavo.kernels.int4.int4_linear``'s seam for a backend's kernel (``octavo_quant_kernels``
-> ``int4_matmul``), and the int4 methods passing their kernels to it."""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.int4 import (
    dequantize_int4,
    from_panels,
    int4_linear,
    int4_linear_reference,
    is_panels,
    pack_awq,
    pack_cols,
    pack_rows,
    quantize_int4,
    to_panels,
    unpack_rows,
    word_shape,
)
from octavo.model_executor.layers.quantization.base import LinearShape, QuantizationSource
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


def test_panels_hold_the_same_words_in_32_output_runs():
    qweight, scales, zeros = int4_operands(n=96, k=256)
    panels = to_panels(qweight)
    assert panels.shape == (3, 32, 32) and panels.is_contiguous()
    assert is_panels(panels) and not is_panels(qweight)
    assert word_shape(panels) == word_shape(qweight) == (32, 96)
    # word (r, n) at [n // 32, r, n % 32]
    assert panels[2, 5, 7] == qweight[5, 2 * 32 + 7]
    assert torch.equal(from_panels(panels), qweight)
    assert torch.equal(dequantize_int4(panels, scales, zeros, 128),
                       dequantize_int4(qweight, scales, zeros, 128))
    x = torch.randn(3, 256)
    assert torch.equal(int4_linear(x, panels, scales, zeros, 128),
                       int4_linear_reference(x, qweight, scales, zeros, 128))
    with pytest.raises(ValueError, match="multiple of 32"):
        to_panels(int4_operands(n=40, k=256)[0])


class PanelKernels:
    """A backend that asks for panels at load and takes no matmul."""

    def __init__(self, answer=None) -> None:
        self.answer = answer
        self.prepared: list[tuple[tuple[int, ...], int, bool]] = []

    def int4_prepare_qweight(self, qweight, group_size, g_idx):
        self.prepared.append((tuple(qweight.shape), group_size, g_idx is not None))
        return to_panels(qweight) if self.answer is None else self.answer


def _loaded_layer(config, qweight, scales, zeros):
    """A layer of ``config``'s method after its checkpoint tensors load (GPTQ v2 zeros or
    AWQ's packing), processed as the loader does."""
    method = config.linear_method("model.layers.0.mlp.down_proj", ())
    layer = nn.Module()
    k = qweight.shape[0] * 8
    shape = LinearShape(input_size=k, output_sizes=(qweight.shape[1],), full_input_size=k,
                        input_start=0, params_dtype=torch.float16)
    method.create_weights(layer, shape)
    values = unpack_rows(qweight)  # [K, N]
    zero_values = zeros.round().to(torch.int32)
    if isinstance(config, AWQConfig):
        layer.qweight.data.copy_(pack_awq(values))
        layer.qzeros.data.copy_(pack_awq(zero_values))
    else:
        layer.qweight.data.copy_(qweight)
        layer.qzeros.data.copy_(pack_cols(zero_values))
    layer.scales.data.copy_(scales)
    method.process_weights_after_loading(layer)
    return method, layer


def test_int4_methods_store_the_words_the_backend_asks_for_at_load():
    qweight, scales, zeros = int4_operands(n=64, k=256)
    x = torch.randn(2, 256)
    expected = int4_linear_reference(x, qweight, scales, zeros, 128)
    for config in (GPTQConfig.from_source(QuantizationSource(
                       {"bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"})),
                   AWQConfig.from_source(QuantizationSource({"bits": 4, "group_size": 128,
                                                             "version": "gemm"}))):
        config.kernels = PanelKernels()
        method, layer = _loaded_layer(config, qweight, scales, zeros)
        assert config.kernels.prepared == [((32, 64), 128, False)]
        assert is_panels(layer.qweight) and torch.equal(from_panels(layer.qweight), qweight)
        assert torch.equal(method.apply(layer, x, None), expected)
        assert torch.equal(method.dequantized_weight(layer, torch.float32),
                           dequantize_int4(qweight, scales, zeros, 128))
        # words of another shape are refused at load, not at the first matmul
        config.kernels = PanelKernels(answer=torch.zeros(64, 32, dtype=torch.int32))
        with pytest.raises(ValueError, match="int4_prepare_qweight returned"):
            _loaded_layer(config, qweight, scales, zeros)
