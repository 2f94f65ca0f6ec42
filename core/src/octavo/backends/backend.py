"""``Backend``: what a hardware plugin says about itself through ``octavo_register_backends``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, slots=True)
class Availability:
    """Answer of a backend's availability probe."""

    # Whether the backend can run here.
    available: bool
    # Why not (or a short description of the device found when it is available).
    reason: str


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend supports; the core checks configurations against it at start-up."""

    # Model/KV dtypes the kernels handle, as torch dtype names ("float32", "bfloat16", ...).
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # KV-cache block sizes the kernels handle (None: any positive size).
    block_sizes: tuple[int, ...] | None = None
    # Whether decode steps can be captured as CUDA graphs.
    cuda_graphs: bool = False


@dataclass(frozen=True, slots=True)
class Backend:
    """One hardware backend, as registered by its plugin.

    ``is_available`` must be cheap and must not initialise a device runtime eagerly beyond
    what is needed to answer (it is called by ``octavo backends`` for every backend).
    """

    # Short unique name used by --device, e.g. "cpu", "cuda".
    name: str
    # torch device type tensors live on ("cpu", "cuda").
    device_type: str
    # Higher wins when no device is named and several backends are available.
    priority: int
    # Probe: can this backend run on this machine, and if not, why.
    is_available: Callable[[], Availability]
    # Distribution that provides it (shown in listings and error messages).
    package: str
    # torch.distributed process-group backend for tensor parallelism ("gloo", "nccl").
    dist_backend: str = "gloo"
    # What the kernels support.
    capabilities: BackendCapabilities = field(default_factory=BackendCapabilities)
    # One line for `octavo backends`.
    description: str = ""
