"""KV-cache sizing on the host: a fixed size in GiB, so it is the same from run to run.

Like vLLM's CPU backend (``VLLM_CPU_KVCACHE_SPACE``), the size is given in GiB:
``--cpu-kv-cache-space`` / ``LLM(cpu_kv_cache_space=...)``, else ``OCTAVO_CPU_KVCACHE_SPACE``,
else :data:`DEFAULT_KV_CACHE_SPACE_GIB` (4 GiB), lowered to half the host memory available
after loading when that is less (a small machine). ``kv_cache_memory_bytes`` (exact bytes) and
``cpu_kv_cache_fraction`` (a share of the available memory, which varies from run to run) win
when set. Whatever the source, the cache is capped at what ``max_num_seqs`` sequences of
``max_model_len`` tokens could ever use.
"""

from __future__ import annotations

import logging

import psutil
from octavo import envs
from octavo.config import CacheConfig

logger = logging.getLogger("octavo.cpu.memory")  # under the octavo logger tree

GiB = 2**30
# KV-cache size when none is given, in GiB (lowered to half the available memory if less).
DEFAULT_KV_CACHE_SPACE_GIB = 4.0


def available_kv_cache_memory(worker, cache_config: CacheConfig) -> int:
    """Bytes for the KV cache (see the module docstring for where the size comes from).

    Raises ``RuntimeError`` when an explicitly given size is more than the host memory
    available, ``ValueError`` for a malformed ``OCTAVO_CPU_KVCACHE_SPACE``.
    """
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    available = psutil.virtual_memory().available
    budget, source = _budget(cache_config, available)
    useful = worker.max_useful_kv_cache_bytes()
    if useful < budget:
        source += f"; capped at {useful / GiB:.2f} GiB, all that max_num_seqs sequences of " \
                  "max_model_len tokens can use"
    logger.info("CPU KV cache: %.2f GiB (%s; host memory available %.2f GiB)",
                min(budget, useful) / GiB, source, available / GiB)
    return min(budget, useful)


def _budget(cache_config: CacheConfig, available: int) -> tuple[int, str]:
    """(bytes, where that size came from) before the max_num_seqs cap."""
    if cache_config.cpu_kv_cache_fraction is not None:
        fraction = cache_config.cpu_kv_cache_fraction
        return int(available * fraction), f"cpu_kv_cache_fraction {fraction:g}"
    space, source = cache_config.cpu_kv_cache_space, "cpu_kv_cache_space"
    if space is None:
        space, source = envs.cpu_kvcache_space(), "OCTAVO_CPU_KVCACHE_SPACE"
    if space is None:
        default = int(DEFAULT_KV_CACHE_SPACE_GIB * GiB)
        if default <= available // 2:
            return default, f"default {DEFAULT_KV_CACHE_SPACE_GIB:g} GiB"
        return available // 2, (f"default {DEFAULT_KV_CACHE_SPACE_GIB:g} GiB lowered to half "
                                "the host memory available")
    budget = int(space * GiB)
    if budget > available:
        raise RuntimeError(
            f"the CPU KV cache was asked for {space:g} GiB ({source}) but only "
            f"{available / GiB:.2f} GiB of host memory is available; give a smaller size"
        )
    return budget, f"{source} {space:g} GiB"
