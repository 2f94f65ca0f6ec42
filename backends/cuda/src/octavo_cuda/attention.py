"""The CUDA backend's attention: the portable Triton kernels with NVIDIA launch parameters."""

from __future__ import annotations

from octavo.config import CacheConfig, ModelConfig
from octavo.kernels.triton import TritonAttentionBackend, TritonLaunchConfig


def make_attention_backend(
    model_config: ModelConfig, cache_config: CacheConfig
) -> TritonAttentionBackend:
    """The Triton kernels with their default (NVIDIA) launch settings, for every model.

    fp32 models keep exact ("ieee") dots so fp32 runs can be compared with HF closely.
    """
    return TritonAttentionBackend(TritonLaunchConfig())
