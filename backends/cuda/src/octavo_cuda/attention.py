"""The CUDA backend's attention: the portable Triton kernels with NVIDIA launch parameters."""

from __future__ import annotations

from octavo.config import ModelConfig


def make_attention_backend(model_config: ModelConfig):
    from octavo.kernels.triton import TritonAttentionBackend, TritonLaunchConfig

    # fp32 models keep exact ("ieee") dots so fp32 runs can be compared with HF closely.
    return TritonAttentionBackend(TritonLaunchConfig())
