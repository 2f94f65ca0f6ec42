"""KV-cache sizing: the backend's ``octavo_available_kv_cache_memory`` answer is sane.

Asked the way the worker asks it (weights loaded, KV cache not yet allocated), with the
default memory budget: a positive number of bytes, room for at least one block, and no more
than the device has. An exact ``kv_cache_memory_bytes`` is returned as is.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from octavo.testing.device_memory import total_device_memory
from octavo.testing.engines import engine_config, make_worker


@pytest.fixture(scope="module")
def loaded_worker(octavo_pm, octavo_plan, octavo_tiny_model):
    """The backend's worker with the tiny model loaded and no KV cache, sized from memory."""
    config = engine_config(octavo_plan, octavo_tiny_model("llama"), kv_cache_memory_bytes=None,
                           num_gpu_blocks_override=None)
    worker = make_worker(octavo_pm, config)
    worker.init_device()
    worker.load_model()
    yield worker
    worker.shutdown()


def ask(pm, worker, cache_config):
    return pm.hook.octavo_available_kv_cache_memory(
        backend=worker.config.backend, worker=worker, cache_config=cache_config
    )


def test_available_kv_cache_memory_is_positive_and_within_the_device(octavo_pm, loaded_worker):
    available = ask(octavo_pm, loaded_worker, loaded_worker.config.cache_config)
    assert available is not None, "octavo_available_kv_cache_memory returned None"
    assert isinstance(available, int) and not isinstance(available, bool), (
        f"the hook must return bytes as an int, got {available!r}"
    )
    per_block = loaded_worker.kv_cache_bytes_per_block()
    assert available >= per_block, (
        f"{available} bytes leave no room for one KV block of {per_block} bytes"
    )
    total = total_device_memory(loaded_worker.device)
    assert available <= total, (
        f"{available / 2**30:.2f} GiB for the KV cache, but {loaded_worker.device} has only "
        f"{total / 2**30:.2f} GiB"
    )


def test_exact_kv_cache_memory_bytes_is_returned_as_is(octavo_pm, loaded_worker):
    per_block = loaded_worker.kv_cache_bytes_per_block()
    exact = replace(loaded_worker.config.cache_config, kv_cache_memory_bytes=7 * per_block + 3)
    assert ask(octavo_pm, loaded_worker, exact) == 7 * per_block + 3

