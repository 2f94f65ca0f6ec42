"""Portable Triton kernels (paged attention, fused elementwise) and the ``"triton"`` backend.

Importing this package imports Triton (never ``octavo.kernels`` alone). The kernels use only
standard Triton (``tl.load``/``tl.store``/``tl.dot``, no Hopper-only features), so the same code
serves NVIDIA and AMD GPUs; device-specific tuning goes through ``TritonLaunchConfig``.

| module | entry point | checked against |
|---|---|---|
| ``cache_write`` | ``write_kv_cache``: scatter K/V into slots | ``write_kv_reference`` |
| ``prefill_attention`` | ``prefill_attention``: causal, prefix | ``paged_attention_reference`` |
| ``decode_attention`` | ``decode_attention``: split-K + reduce | ``paged_attention_reference`` |
| ``attention`` | ``TritonAttentionBackend``, ``TritonAttentionImpl`` | ``ReferenceAttentionImpl`` |
| ``rmsnorm`` | ``rms_norm``, ``fused_add_rms_norm`` | ``RMSNorm.forward_native`` |
| ``rotary`` | ``apply_rotary``: query and key, one launch | ``RotaryEmbedding.forward_native`` |
| ``activation`` | ``silu_and_mul`` | ``SiluAndMul.forward_native`` |
| ``fused_moe`` | ``fused_moe``: top-k experts, grouped GEMMs | ``fused_moe_reference`` |

``rmsnorm``, ``rotary`` and ``activation`` are the fused elementwise kernels and ``fused_moe``
the mixture-of-experts kernel that the model layers (``octavo.model_executor.layers``)
dispatch to on CUDA tensors (``fused_moe`` is imported from its module, not re-exported here).

Under ``TRITON_INTERPRET=1`` (read by Triton itself when a kernel is defined, so it must be set
before this package is imported) every kernel runs on CPU tensors, which is how CI tests them.
"""

from octavo.kernels.triton.activation import silu_and_mul
from octavo.kernels.triton.attention import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonLaunchConfig,
)
from octavo.kernels.triton.cache_write import write_kv_cache
from octavo.kernels.triton.decode_attention import decode_attention
from octavo.kernels.triton.prefill_attention import prefill_attention
from octavo.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm
from octavo.kernels.triton.rotary import apply_rotary

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonLaunchConfig",
    "apply_rotary",
    "decode_attention",
    "fused_add_rms_norm",
    "prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
