"""KV-cache sizing on a GPU: profile the largest step, then fill ``gpu_memory_utilization``.

Shared by the CUDA and ROCm backends: on ROCm builds of torch the ``torch.cuda`` memory API is
HIP underneath (``mem_get_info`` is ``hipMemGetInfo``, and the caching allocator's statistics
count HIP allocations). The budget arithmetic is a pure function, tested without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from octavo.config import CacheConfig

if TYPE_CHECKING:
    from octavo.worker.worker import Worker

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What the profiling run measured on one device, in bytes."""

    # Device memory as the driver reports it.
    total: int
    # Free device memory after the profiling run.
    free: int
    # Peak bytes allocated by torch during the profiling run (weights + activations).
    torch_peak: int
    # Bytes torch's caching allocator holds from the driver (allocated or cached).
    torch_reserved: int

    @property
    def outside_torch(self) -> int:
        """Used memory torch does not account for: the driver context, NCCL/RCCL, other
        processes."""
        return max((self.total - self.free) - self.torch_reserved, 0)


def kv_cache_budget(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache under ``gpu_memory_utilization * total`` (may be <= 0)."""
    budget = int(profile.total * gpu_memory_utilization)
    return budget - profile.torch_peak - profile.outside_torch


def measure(worker: Worker) -> MemoryProfile:
    """Run ``worker.profile_run()`` on a clean peak counter and read the device's figures."""
    device = worker.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    worker.profile_run()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(
        total=total,
        free=free,
        torch_peak=torch.cuda.max_memory_allocated(device),
        torch_reserved=torch.cuda.memory_reserved(device),
    )


def available_kv_cache_memory(worker: Worker, cache_config: CacheConfig) -> int:
    """Bytes for the KV cache on ``worker.device``.

    ``kv_cache_memory_bytes`` wins when set. Otherwise: run ``worker.profile_run()`` (the
    largest step the scheduler may build) and give the KV cache what is left of
    ``gpu_memory_utilization * total`` after the peak torch memory of that run (weights and
    activations) and the memory held outside torch's allocator.
    """
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    profile = measure(worker)
    utilization = cache_config.gpu_memory_utilization
    available = kv_cache_budget(profile, utilization)
    budget = profile.total * utilization
    logger.info(
        "GPU memory on %s: total %.2f GiB, budget %.2f GiB (utilization %.2f), torch peak "
        "%.2f GiB, outside torch %.2f GiB -> KV cache %.2f GiB",
        worker.device, profile.total / _GIB, budget / _GIB, utilization,
        profile.torch_peak / _GIB, profile.outside_torch / _GIB, available / _GIB,
    )
    if available <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache on {worker.device}: budget "
            f"{budget / _GIB:.2f} GiB of {profile.total / _GIB:.2f} GiB, peak use "
            f"{profile.torch_peak / _GIB:.2f} GiB, {profile.outside_torch / _GIB:.2f} GiB held "
            "outside torch. Raise gpu_memory_utilization, lower max_num_batched_tokens, or "
            "free the GPU (nvidia-smi / rocm-smi show what holds it)."
        )
    return available
