"""The template backend's declaration (entry point
``template = "octavo_template_accel.plugin:plugin"``).

Discovery imports this module in every process that lists or selects backends, so it imports
no device runtime and no kernels: ``BackendPlugin`` imports those once the backend is chosen,
and answers ``None`` to every selection hook asked about another backend.

The template runs on the host (device type ``cpu``) with priority -10, below the ``cpu``
backend's 0: installing it never changes the backend users get by default; it runs when
asked for (``--device template``). A real accelerator backend sits above ``cpu`` (the CUDA
backend uses 100).
"""

from __future__ import annotations

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.backends.plugin import BackendPlugin

BACKEND_NAME = "template"


def _probe() -> Availability:
    # VENDOR: answer cheaply whether this machine has your device (driver loaded, a device
    # visible) and say why not when it has none; never initialise the device here.
    return Availability(True, "template accelerator emulated on the host")


# VENDOR: the whole hook surface of a backend is this declaration: the core's BackendPlugin
# registers the Backend and, for this backend's name only, imports and returns the three
# pieces below when the backend is chosen. The entry point names this object:
#   [project.entry-points.octavo]
#   template = "octavo_template_accel.plugin:plugin"
plugin = BackendPlugin(
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
    ),
    attention="octavo_template_accel.attention:make_attention_backend",
    worker="octavo_template_accel.worker:TemplateWorker",
    kv_cache_memory="octavo_template_accel.memory:available_kv_cache_memory",
)
