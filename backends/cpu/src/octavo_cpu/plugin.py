"""The CPU backend's declaration (entry point ``cpu = "octavo_cpu.plugin:plugin"``).

Importing this module is cheap: torch and the kernels load only when the backend is chosen.
"""

from __future__ import annotations

import os

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.backends.plugin import BackendPlugin

BACKEND_NAME = "cpu"


def _probe() -> Availability:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Availability(True, f"{cores} CPU cores")


plugin = BackendPlugin(
    Backend(
        name=BACKEND_NAME,
        device_type="cpu",
        priority=0,  # every machine has one; any accelerator backend should win
        is_available=_probe,
        package="octavo-backend-cpu",
        dist_backend="gloo",
        capabilities=BackendCapabilities(
            dtypes=("float32", "bfloat16", "float16"),
            head_dims=None,  # any: C++ kernels for multiples of 16, torch for the others
            block_sizes=None,  # any block size
            cuda_graphs=False,
            sliding_window=True,  # C++ kernels and torch fallback alike
            logits_soft_cap=True,
            # Every built-in method: fp8 weights dequantized to the activations' dtype in the
            # matmul, int4 AWQ/GPTQ and GGUF blocks dequantized tile by tile (GGUF through the
            # backend's C++ op where it is built, octavo_cpu.quant_kernels).
            quantization_methods=("fp8", "compressed-tensors", "awq", "gptq", "gguf"),
            # fp8 (e4m3) KV cache through the torch attention path (the C++ kernels take
            # 16/32-bit caches only).
            kv_cache_dtypes=("auto", "fp8"),
            # No limit of its own on max_num_seqs / max_model_len (host memory decides);
            # logprobs come from the core's sampler, so every count and prompt logprobs.
        ),
        description="paged attention on the host CPU (C++ AVX2/AVX-512 kernels, torch fallback)",
    ),
    attention="octavo_cpu.attention:make_attention_backend",
    worker="octavo_cpu.worker:CPUWorker",
    kv_cache_memory="octavo_cpu.memory:available_kv_cache_memory",
    quant_kernels="octavo_cpu.quant:quant_kernels",
)
