"""Choosing the backend: ``--device NAME`` if given, else the available one of highest priority."""

from __future__ import annotations

import logging

import pluggy

from octavo.backends.backend import Availability, Backend

logger = logging.getLogger(__name__)

# Backends Octavo's own repository provides, for install hints when none is installed.
KNOWN_BACKEND_PACKAGES = {
    "cpu": "octavo-backend-cpu (pip install ./backends/cpu)",
    "cuda": "octavo-backend-cuda (pip install ./backends/cuda)",
    "rocm": "octavo-backend-rocm (pip install ./backends/rocm)",
}


class BackendNotAvailableError(RuntimeError):
    """No backend can run the model: none installed, the named one missing or unavailable."""


def list_backends(pm: pluggy.PluginManager) -> list[Backend]:
    """Every backend registered by installed plugins, highest priority first."""
    backends: list[Backend] = []

    def register(backend: Backend) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"octavo_register_backends must register Backend objects, got {backend!r}")
        if any(b.name == backend.name for b in backends):
            raise ValueError(f"two plugins register a backend named {backend.name!r}")
        backends.append(backend)

    pm.hook.octavo_register_backends(register=register)
    return sorted(backends, key=lambda b: -b.priority)


def probe(backend: Backend) -> Availability:
    """Run a backend's availability probe, turning a crash into an 'unavailable' answer."""
    try:
        return backend.is_available()
    except Exception as exc:  # a broken probe must not hide the other backends
        return Availability(False, f"availability probe failed: {exc!r}")


def select_backend(pm: pluggy.PluginManager, device: str | None = None) -> Backend:
    """Return the backend to run on, or raise ``BackendNotAvailableError`` saying what to do."""
    backends = list_backends(pm)
    if not backends:
        hints = "; ".join(KNOWN_BACKEND_PACKAGES.values())
        raise BackendNotAvailableError(
            "No Octavo backend is installed, so no model can run. Install one, e.g. "
            f"{hints}. `octavo backends` lists what is installed."
        )
    if device is not None:
        by_name = {b.name: b for b in backends}
        if device not in by_name:
            hint = KNOWN_BACKEND_PACKAGES.get(device)
            install = f" Install {hint}." if hint else ""
            raise BackendNotAvailableError(
                f"Backend {device!r} is not installed.{install} Installed backends: "
                f"{sorted(by_name)}."
            )
        answer = probe(by_name[device])
        if not answer.available:
            raise BackendNotAvailableError(
                f"Backend {device!r} is installed but not available here: {answer.reason}"
            )
        return by_name[device]
    reasons = []
    for backend in backends:
        answer = probe(backend)
        if answer.available:
            logger.debug("selected backend %s (%s)", backend.name, answer.reason)
            return backend
        reasons.append(f"{backend.name}: {answer.reason}")
    missing = [hint for name, hint in KNOWN_BACKEND_PACKAGES.items()
               if name not in {b.name for b in backends}]
    install = f" Install one that runs here, e.g. {'; '.join(missing)}." if missing else ""
    raise BackendNotAvailableError(
        "No installed backend is available on this machine (" + "; ".join(reasons) + ")."
        + install
    )
