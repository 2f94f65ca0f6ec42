"""Hook implementations of the CPU backend (entry point ``octavo = cpu``).

Importing this module is cheap: torch and the kernels load only when the backend is chosen.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.hookspecs import hookimpl

BACKEND_NAME = "cpu"


def _probe() -> Availability:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Availability(True, f"{cores} CPU cores")


@hookimpl
def octavo_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name=BACKEND_NAME,
            device_type="cpu",
            priority=0,  # every machine has one; any accelerator backend should win
            is_available=_probe,
            package="octavo-backend-cpu",
            dist_backend="gloo",
            capabilities=BackendCapabilities(
                dtypes=("float32", "bfloat16", "float16"),
                head_dims=None,  # torch attention: any head size
                block_sizes=None,  # any block size
                cuda_graphs=False,
                # No limit of its own on max_num_seqs / max_model_len (host memory decides);
                # logprobs come from the core's sampler, so every count and prompt logprobs.
            ),
            description="torch paged attention on the host CPU",
        )
    )


@hookimpl
def octavo_attention_backend(backend, model_config, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_cpu.attention import CPUAttentionBackend

    return CPUAttentionBackend()


@hookimpl
def octavo_available_kv_cache_memory(backend, worker, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_cpu.memory import available_kv_cache_memory

    return available_kv_cache_memory(worker, cache_config)


@hookimpl
def octavo_worker_class(backend, parallel_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_cpu.worker import CPUWorker

    return CPUWorker
