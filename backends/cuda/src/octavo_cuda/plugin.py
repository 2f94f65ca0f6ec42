"""The CUDA backend's declaration (entry point ``cuda = "octavo_cuda.plugin:plugin"``).

The backend is the core's GPU worker, GPU memory sizing and decode CUDA graphs with the
portable Triton kernels (``octavo.kernels.triton_support.triton_gpu_backend_plugin``), at
NVIDIA launch settings (``octavo_cuda.attention``), plus one CUDA C++ kernel of its own: the
tensor-core int4 GEMV (``octavo_cuda.quant``). Importing this module is cheap: torch is
imported only by the availability probe, and the kernels only when the backend is chosen.
"""

from __future__ import annotations

from octavo.backends.backend import Availability
from octavo.kernels.triton_support import triton_gpu_backend_plugin

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


plugin = triton_gpu_backend_plugin(
    BACKEND_NAME,
    is_available=probe_cuda,
    package="octavo-backend-cuda",
    attention="octavo_cuda.attention:make_attention_backend",
    description="Triton paged attention on NVIDIA GPUs",
    # the tensor-core int4 GEMV (CUDA C++ compiled with NVRTC) for gptq/awq at 1-8 rows
    quant_kernels="octavo_cuda.quant:quant_kernels",
)
