"""KV-cache sizing for the template device: what is left of its memory after a profiling run.

VENDOR: replace ``device_memory`` and ``peak_bytes_during`` with your runtime's calls (the CUDA
backend uses ``torch.cuda.mem_get_info``, ``reset_peak_memory_stats`` and
``max_memory_allocated``). The template's "device" is the host, which has no peak-memory
counter, so it counts no activation peak and gives the KV cache ``cpu_kv_cache_fraction`` of
the available memory (:data:`DEFAULT_FRACTION` when not set).
"""

from __future__ import annotations

import logging

import psutil
from octavo.config import CacheConfig

logger = logging.getLogger(__name__)

# Share of the template device's free memory for the KV cache when cpu_kv_cache_fraction is unset.
DEFAULT_FRACTION = 0.25


def device_memory(device) -> tuple[int, int]:
    """(free, total) bytes of ``device``. VENDOR: ask your driver."""
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def peak_bytes_during(worker) -> int:
    """Run ``worker.profile_run()`` and return the peak bytes it allocated on the device.

    VENDOR: reset your allocator's peak counter, run, synchronise, read the peak.
    """
    worker.profile_run()
    return 0


def available_kv_cache_memory(worker, cache_config: CacheConfig) -> int:
    """Bytes for the KV cache: ``kv_cache_memory_bytes`` when set, else the device's free
    memory share minus the profiled peak, capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens could ever use."""
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    peak = peak_bytes_during(worker)
    free, total = device_memory(worker.device)
    fraction = cache_config.cpu_kv_cache_fraction or DEFAULT_FRACTION
    budget = int(free * fraction) - peak
    useful = worker.max_useful_kv_cache_bytes()
    logger.debug("template device: %.2f of %.2f GiB free, peak %.2f GiB, KV budget %.2f GiB",
                 free / 2**30, total / 2**30, peak / 2**30, budget / 2**30)
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache on {worker.device}: {free / 2**30:.2f} GiB free, "
            f"profiling peaked at {peak / 2**30:.2f} GiB. Free memory or set "
            "kv_cache_memory_bytes."
        )
    return min(budget, useful)
