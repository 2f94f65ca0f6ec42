"""Hook implementations of the template backend (entry point ``octavo = template``).

Discovery imports this module in every process that lists or selects backends, so it imports
no device runtime and no kernels: those load inside the hooks, once the backend is chosen.
Every selection hook answers ``None`` for a backend name that is not its own.

The template runs on the host (device type ``cpu``) with priority -10, below the ``cpu``
backend's 0: installing it never changes the backend users get by default; it runs when
asked for (``--device template``). A real accelerator backend sits above ``cpu`` (the CUDA
backend uses 100).
"""

from __future__ import annotations

from collections.abc import Callable

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.hookspecs import hookimpl

BACKEND_NAME = "template"


def _probe() -> Availability:
    # VENDOR: answer cheaply whether this machine has your device (driver loaded, a device
    # visible) and say why not when it has none; never initialise the device here.
    return Availability(True, "template accelerator emulated on the host")


@hookimpl
def octavo_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name=BACKEND_NAME,
            device_type="cpu",  # VENDOR: your torch device type, e.g. "cuda", "xpu", "privateuseone"
            priority=-10,  # below cpu (0): never the default while the cpu backend is installed
            is_available=_probe,
            package="octavo-plugin-template-accelerator",
            dist_backend="gloo",  # VENDOR: your collective library for tensor parallelism
            # VENDOR: declare what your kernels support (see BackendCapabilities: head sizes,
            # block sizes, limits); the core refuses other configurations at start-up and the
            # conformance suite tests exactly what is declared here.
            capabilities=BackendCapabilities(dtypes=("float32", "bfloat16"), block_sizes=None),
            description="template accelerator (plain torch on the host); copy and rename",
        )
    )


@hookimpl
def octavo_attention_backend(backend, model_config, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_template_accel.attention import TemplateAttentionBackend

    return TemplateAttentionBackend()


@hookimpl
def octavo_available_kv_cache_memory(backend, worker, cache_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_template_accel.memory import available_kv_cache_memory

    return available_kv_cache_memory(worker, cache_config)


@hookimpl
def octavo_worker_class(backend, parallel_config):
    if backend != BACKEND_NAME:
        return None
    from octavo_template_accel.worker import TemplateWorker

    return TemplateWorker
