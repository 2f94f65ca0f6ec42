"""Backend descriptions, selection, and capability negotiation."""

from octavo.backends.backend import Availability, Backend, BackendCapabilities
from octavo.backends.capabilities import UnsupportedByBackendError, check_config, check_request
from octavo.backends.selection import BackendNotAvailableError, list_backends, select_backend

__all__ = [
    "Availability",
    "Backend",
    "BackendCapabilities",
    "BackendNotAvailableError",
    "UnsupportedByBackendError",
    "check_config",
    "check_request",
    "list_backends",
    "select_backend",
]
