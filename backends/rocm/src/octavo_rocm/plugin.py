"""The ROCm backend's declaration (entry point ``rocm = "octavo_rocm.plugin:plugin"``).

The backend is the core's GPU worker, GPU memory sizing and graph capture (ROCm builds of
torch keep the ``torch.cuda`` API) with the portable Triton kernels at AMD launch settings
(``octavo_rocm.attention``). Importing this module is cheap: torch is imported only by the
availability probe, and the kernels only when the backend is chosen.

On ROCm, PyTorch keeps the CUDA names: tensors live on device type ``"cuda"``,
``torch.cuda.*`` calls go to HIP, and ``torch.version.cuda`` is ``None`` while
``torch.version.hip`` holds the HIP version. A build is therefore told apart by
``torch.version.hip``, never by ``torch.cuda.is_available()`` alone, which is true on both.
"""

from __future__ import annotations

import importlib.util

from octavo.backends.backend import Availability
from octavo.kernels.triton_support import triton_gpu_backend_plugin

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


# As cuda: the same kernels (each block size tested with the ROCm launch settings), decode
# steps captured as HIP graphs by the core's graph runner (torch.cuda.CUDAGraph is hipGraph on
# ROCm builds; never run on AMD hardware yet, see docs/rocm.md), async scheduling (HIP kernels
# run asynchronously to the host, as CUDA ones do), RCCL as the "nccl" process-group backend.
plugin = triton_gpu_backend_plugin(
    BACKEND_NAME,
    is_available=probe_rocm,
    package="octavo-backend-rocm",
    attention="octavo_rocm.attention:make_attention_backend",
    description="Triton paged attention on AMD GPUs (ROCm/HIP), tuned for CDNA3",
    # CDNA3's fp8 is e4m3fnuz, not the e4m3fn the fp8 KV cache stores: not run there yet.
    kv_cache_dtypes=("auto",),
)
