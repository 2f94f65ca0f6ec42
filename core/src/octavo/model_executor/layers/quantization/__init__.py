"""Quantization methods: how a linear layer's weights are stored and multiplied.

- ``base``: the contract (``QuantizationConfig`` -> ``LinearMethod`` per linear layer:
  ``create_weights``, ``process_weights_after_loading``, ``apply``).
- ``registry``: methods by name (``octavo_register_quantization_methods``), which one a model
  runs with (``--quantization`` and the checkpoint's ``quantization_config``).
- the built-in methods: ``fp8``, ``compressed-tensors`` (its FP8 schemes), ``awq``, ``gptq``
  (int4 weight-only) and ``gguf`` (llama.cpp blocks kept quantized).

See docs/quantization.md.
"""

from __future__ import annotations


def builtin_methods() -> list[type]:
    """The ``QuantizationConfig`` classes Octavo ships."""
    from octavo.model_executor.layers.quantization.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from octavo.model_executor.layers.quantization.fp8 import Fp8Config
    from octavo.model_executor.layers.quantization.gguf import GGUFConfig
    from octavo.model_executor.layers.quantization.int4 import AWQConfig, GPTQConfig

    return [Fp8Config, CompressedTensorsConfig, GPTQConfig, AWQConfig, GGUFConfig]
