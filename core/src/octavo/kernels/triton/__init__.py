"""Portable Triton paged-attention kernels and the ``"triton"`` attention backend.

Importing this package imports Triton (never ``octavo.kernels`` alone). The kernels use only
standard Triton (``tl.load``/``tl.store``/``tl.dot``, no Hopper-only features), so the same code
serves NVIDIA and AMD GPUs; device-specific tuning goes through ``TritonLaunchConfig``.

| module | kernel | reference |
|---|---|---|
| ``cache_write`` | ``write_kv_cache``: scatter new K/V into cache slots | ``write_kv_reference`` |
| ``prefill_attention`` | ``prefill_attention``: causal attention with cached prefix | ``paged_attention_reference`` |
| ``decode_attention`` | ``decode_attention``: one token per sequence, split-K + reduce | ``paged_attention_reference`` |
| ``attention`` | ``TritonAttentionBackend`` / ``TritonAttentionImpl`` | ``ReferenceAttentionImpl`` |

Under ``TRITON_INTERPRET=1`` (read by Triton itself when a kernel is defined, so it must be set
before this package is imported) every kernel runs on CPU tensors, which is how CI tests them.
"""

from octavo.kernels.triton.attention import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonLaunchConfig,
)
from octavo.kernels.triton.cache_write import write_kv_cache
from octavo.kernels.triton.decode_attention import decode_attention
from octavo.kernels.triton.prefill_attention import prefill_attention

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonLaunchConfig",
    "decode_attention",
    "prefill_attention",
    "write_kv_cache",
]
