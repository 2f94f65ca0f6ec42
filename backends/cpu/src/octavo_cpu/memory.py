"""KV-cache sizing on the host: a share of the memory still available after loading."""

from __future__ import annotations

import logging

import psutil
from octavo.config import CacheConfig

logger = logging.getLogger(__name__)


def available_kv_cache_memory(worker, cache_config: CacheConfig) -> int:
    """Bytes for the KV cache.

    ``kv_cache_memory_bytes`` when set; else ``cpu_kv_cache_fraction`` of the memory available
    now (the weights are already loaded, so they are accounted for), capped at what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use.
    """
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    available = psutil.virtual_memory().available
    budget = int(available * cache_config.cpu_kv_cache_fraction)
    useful = worker.max_useful_kv_cache_bytes()
    logger.debug(
        "host memory available %.2f GiB; KV budget %.2f GiB (fraction %.2f), useful at most %.2f GiB",
        available / 2**30, budget / 2**30, cache_config.cpu_kv_cache_fraction, useful / 2**30,
    )
    return min(budget, useful)
