"""Hook implementations of the ROCm backend (entry point ``octavo = rocm``).

Importing this module is cheap: torch is imported only by the availability probe, and the
kernels only when the backend is chosen.

On ROCm, PyTorch keeps the CUDA names: tensors live on device type ``"cuda"``,
``torch.cuda.*`` calls go to HIP, and ``torch.version.cuda`` is ``None`` while
``torch.version.hip`` holds the HIP version. A build is therefore told apart by
``torch.version.hip``, never by ``torch.cuda.is_available()`` alone, which is true on both.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.hookspecs import hookimpl
from octavo.kernels.triton_support import TRITON_DTYPES, TRITON_HEAD_DIMS

BACKEND_NAME = "rocm"


def probe_rocm() -> Availability:
    """Available when torch is a ROCm (HIP) build, sees a device, and Triton is importable."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a core dependency
        return Availability(False, f"torch cannot be imported: {exc}")
    hip = getattr(torch.version, "hip", None)
    if not hip:
        if torch.version.cuda is not None:
            return Availability(
                False,
                f"torch is a CUDA build (CUDA {torch.version.cuda}), not ROCm; use "
                "octavo-backend-cuda, or install a ROCm build of torch for AMD GPUs",
            )
        return Availability(False, "torch is a CPU-only build (torch.version.hip is None)")
    if not torch.cuda.is_available():
        return Availability(
            False,
            f"torch is a ROCm build (HIP {hip}) but no AMD GPU is visible "
            "(torch.cuda.is_available() is False; check HIP_VISIBLE_DEVICES, "
            "ROCR_VISIBLE_DEVICES and access to /dev/kfd and /dev/dri)",
        )
    if importlib.util.find_spec("triton") is None:
        return Availability(
            False,
            "Triton is not importable; ROCm builds of torch ship it as pytorch-triton-rocm",
        )
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
    arch = f" ({arch})" if arch else ""
    return Availability(True, f"{count} x {name}{arch}, HIP {hip}")


@hookimpl
def octavo_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name=BACKEND_NAME,
            device_type="cuda",  # PyTorch's device type for HIP devices too
            # Same as cuda: the two probes exclude each other (torch is a HIP build or a CUDA
            # build, never both), so they are never both available.
            priority=100,
            is_available=probe_rocm,
            package="octavo-backend-rocm",
            # torch.distributed has no "rccl" name: on ROCm builds the "nccl" process-group
            # backend is RCCL (ROCm's NCCL-compatible library) under the same API.
            dist_backend="nccl",
            capabilities=BackendCapabilities(
                dtypes=TRITON_DTYPES,
                head_dims=TRITON_HEAD_DIMS,  # the Triton attention kernels' sizes
                block_sizes=(8, 16, 32, 64),  # as cuda; each is tested with the ROCm config
                # Decode steps run eagerly. HIP graphs work through torch.cuda.CUDAGraph, but
                # the capture/replay runner lives in octavo_cuda, which this package does not
                # depend on; see docs/rocm.md ("HIP graphs").
                cuda_graphs=False,
                # HIP kernels run asynchronously to the host, as CUDA ones do.
                async_scheduling=True,
                # No limit of its own on max_num_seqs / max_model_len (GPU memory decides);
                # logprobs come from the core's sampler, so every count and prompt logprobs.
            ),
            description="Triton paged attention on AMD GPUs (ROCm/HIP), tuned for CDNA3",
        )
    )


@hookimpl
def octavo_attention_backend(backend, model_config, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_rocm.attention import make_attention_backend

    return make_attention_backend(model_config)


@hookimpl
def octavo_available_kv_cache_memory(backend, worker, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_rocm.memory import available_kv_cache_memory

    return available_kv_cache_memory(worker, cache_config)


@hookimpl
def octavo_worker_class(backend, parallel_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_rocm.worker import ROCmWorker

    return ROCmWorker
