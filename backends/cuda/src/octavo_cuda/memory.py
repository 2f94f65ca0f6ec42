"""KV-cache sizing on a GPU: profile the largest step, then fill gpu_memory_utilization."""

from __future__ import annotations

import logging

import torch

from octavo.config import CacheConfig

logger = logging.getLogger(__name__)


def available_kv_cache_memory(worker, cache_config: CacheConfig) -> int:
    """Bytes for the KV cache on ``worker.device``.

    ``kv_cache_memory_bytes`` wins when set. Otherwise: run ``worker.profile_run()`` (the
    largest step the scheduler may build) and give the KV cache what is left of
    ``gpu_memory_utilization * total`` after the peak torch memory of that run (weights and
    activations) and memory held outside torch's allocator (CUDA context, other processes).
    """
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    device = worker.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    worker.profile_run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(total * cache_config.gpu_memory_utilization)
    available = budget - peak - max(outside_torch, 0)
    logger.info(
        "GPU memory: total %.2f GiB, budget %.2f GiB (utilization %.2f), torch peak %.2f GiB, "
        "outside torch %.2f GiB -> KV cache %.2f GiB",
        total / 2**30, budget / 2**30, cache_config.gpu_memory_utilization, peak / 2**30,
        outside_torch / 2**30, available / 2**30,
    )
    if available <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache on {device}: budget {budget / 2**30:.2f} GiB, "
            f"peak use {peak / 2**30:.2f} GiB, {outside_torch / 2**30:.2f} GiB held outside "
            "torch. Raise gpu_memory_utilization, lower max_num_batched_tokens, or free the GPU."
        )
    return available
