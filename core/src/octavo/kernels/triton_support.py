"""What the portable Triton kernels (``octavo.kernels.triton``) support, and how layers reach
them only when Triton is importable.

Importable without Triton or torch: backend plugins built on these kernels (cuda, rocm) declare
``TRITON_GPU_CAPABILITIES`` at discovery time, when importing the kernels would be too costly.
``octavo.kernels.triton.attention`` reads its head sizes from here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from types import ModuleType

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.backends.plugin import BackendPlugin

logger = logging.getLogger(__name__)

#: Head dimensions the kernels accept (non powers of two are padded inside the kernels).
TRITON_HEAD_DIMS = (64, 80, 96, 128, 256)
#: Model/KV-cache dtypes the kernels handle (float32 dots precision: TritonLaunchConfig).
TRITON_DTYPES = ("bfloat16", "float16", "float32")
#: What a GPU backend running these kernels through the core's GPU worker supports: the
#: kernels' dtypes and head sizes, the quantization methods, the block sizes they are tested
#: and tuned for, CUDA (or HIP) graphs of decode and verification steps unless
#: --enforce-eager, async scheduling (the device runs apart from the host), a chunked-prefill
#: budget of 8192 tokens, an fp8 KV cache, sliding-window attention and logit
#: soft-capping. No limit of its own on max_num_seqs / max_model_len (GPU memory decides);
#: logprobs come from the core's sampler, so every count and prompt logprobs.
TRITON_GPU_CAPABILITIES = BackendCapabilities(
    dtypes=TRITON_DTYPES,
    head_dims=TRITON_HEAD_DIMS,
    block_sizes=(8, 16, 32, 64),
    cuda_graphs=True,
    cuda_graphs_multi_token=True,
    async_scheduling=True,
    # vLLM's serving default on large GPUs. With 2048, W1's prompts (134,531 tokens) took 72
    # steps of ~18 ms of host launch work each against ~7 ms of GPU work: 47 % of the run
    # (benchmarks/gpu/w1_timeline.py, docs/benchmarks.md).
    default_max_num_batched_tokens=8192,
    # fp8 through the Triton w8a16 skinny kernel (<= 16 rows) and torch._scaled_mm (more),
    # dequantized where the GPU has no FP8 tensor cores; int4 AWQ/GPTQ through the Triton
    # skinny (<= 16 rows) and dequantize-in-GEMM kernels; GGUF through the latter.
    quantization_methods=("fp8", "compressed-tensors", "awq", "gptq", "gguf"),
    # fp8 (e4m3) KV cache: the write kernel quantizes, the attention kernels upcast.
    kv_cache_dtypes=("auto", "fp8"),
    sliding_window=True,
    logits_soft_cap=True,
)


def triton_gpu_backend_plugin(
    name: str,
    is_available: Callable[[], Availability],
    package: str,
    attention: str,
    description: str,
    kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8"),
    quant_kernels: str | None = None,
) -> BackendPlugin:
    """The declaration of a backend for GPUs that torch addresses as ``cuda`` (NVIDIA through
    CUDA, AMD through ROCm/HIP) running these kernels: the core's ``GPUWorker`` (device
    binding, decode CUDA/HIP graphs), GPU memory sizing, the ``nccl`` process-group backend
    (RCCL on ROCm builds: torch.distributed has no "rccl" name), ``TRITON_GPU_CAPABILITIES``,
    priority 100 (above the CPU; the probes of such backends must exclude each other, as a
    torch build is CUDA or HIP, never both).

    :param attention: reference to the backend's attention factory (its launch settings).
    :param kv_cache_dtypes: the --kv-cache-dtype values the backend's devices run.
    :param quant_kernels: reference to the backend's own kernels for quantization methods
        (``BackendPlugin``'s ``quant_kernels``), if it has any besides these.
    """
    backend = Backend(
        name=name,
        device_type="cuda",  # PyTorch's device type for HIP devices too
        priority=100,
        is_available=is_available,
        package=package,
        dist_backend="nccl",
        capabilities=dataclasses.replace(TRITON_GPU_CAPABILITIES,
                                         kv_cache_dtypes=kv_cache_dtypes),
        description=description,
    )
    return BackendPlugin(
        backend,
        attention=attention,
        worker="octavo.worker.gpu_worker:GPUWorker",
        kv_cache_memory="octavo.worker.gpu_memory:available_kv_cache_memory",
        quant_kernels=quant_kernels,
    )


@functools.cache
def optional_triton_kernels(name: str) -> ModuleType | None:
    """``octavo.kernels.triton.<name>``, or ``None`` when Triton cannot be imported here (the
    layers then run their torch ops). Imported once per process."""
    try:
        return importlib.import_module(f"octavo.kernels.triton.{name}")
    except ImportError as exc:
        logger.debug("Triton kernels %r unavailable, using torch ops: %s", name, exc)
        return None
