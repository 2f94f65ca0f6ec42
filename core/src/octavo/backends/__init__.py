"""Backend descriptions and selection."""

from octavo.backends.backend import Backend, BackendCapabilities, Availability
from octavo.backends.selection import BackendNotAvailableError, list_backends, select_backend

__all__ = [
    "Availability",
    "Backend",
    "BackendCapabilities",
    "BackendNotAvailableError",
    "list_backends",
    "select_backend",
]
