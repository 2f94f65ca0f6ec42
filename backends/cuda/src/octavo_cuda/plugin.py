"""Hook implementations of the CUDA backend (entry point ``octavo = cuda``).

Importing this module is cheap: torch is imported only by the availability probe, and the
kernels only when the backend is chosen.
"""

from __future__ import annotations

from collections.abc import Callable

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.hookspecs import hookimpl
from octavo.kernels.triton_support import TRITON_DTYPES, TRITON_HEAD_DIMS

BACKEND_NAME = "cuda"


def probe_cuda() -> Availability:
    """Available when torch is a CUDA build (not ROCm/HIP) and sees at least one device."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a core dependency
        return Availability(False, f"torch cannot be imported: {exc}")
    if getattr(torch.version, "hip", None):
        return Availability(False, "torch is a ROCm (HIP) build; install octavo-backend-rocm")
    if torch.version.cuda is None:
        return Availability(False, "torch is a CPU-only build (torch.version.cuda is None)")
    if not torch.cuda.is_available():
        return Availability(False, "no CUDA device is visible (torch.cuda.is_available() is False)")
    name = torch.cuda.get_device_name(0)
    count = torch.cuda.device_count()
    return Availability(True, f"{count} x {name}, CUDA {torch.version.cuda}")


@hookimpl
def octavo_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name=BACKEND_NAME,
            device_type="cuda",
            priority=100,
            is_available=probe_cuda,
            package="octavo-backend-cuda",
            dist_backend="nccl",
            capabilities=BackendCapabilities(
                dtypes=TRITON_DTYPES,
                head_dims=TRITON_HEAD_DIMS,  # the Triton attention kernels' sizes
                block_sizes=(8, 16, 32, 64),  # the sizes the kernels are tested and tuned for
                cuda_graphs=True,  # decode steps, unless --enforce-eager
                async_scheduling=True,
                # No limit of its own on max_num_seqs / max_model_len (GPU memory decides);
                # logprobs come from the core's sampler, so every count and prompt logprobs.
            ),
            description="Triton paged attention on NVIDIA GPUs",
        )
    )


@hookimpl
def octavo_attention_backend(backend, model_config, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_cuda.attention import make_attention_backend

    return make_attention_backend(model_config)


@hookimpl
def octavo_available_kv_cache_memory(backend, worker, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_cuda.memory import available_kv_cache_memory

    return available_kv_cache_memory(worker, cache_config)


@hookimpl
def octavo_worker_class(backend, parallel_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_cuda.worker import CUDAWorker

    return CUDAWorker
