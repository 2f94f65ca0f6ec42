"""One ``octavo`` logger tree, backends included (``logging.getLogger(__name__)`` everywhere)."""

import logging
import sys

from octavo import envs

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_configured = False


def configure_logging() -> None:
    """Attach one stderr handler to the ``octavo`` root logger (idempotent).

    Level comes from ``OCTAVO_LOG_LEVEL`` (default INFO). Libraries embedding Octavo that
    configure logging themselves can set ``OCTAVO_LOG_LEVEL=NOTSET`` to leave it alone.
    """
    global _configured
    if _configured:
        return
    _configured = True
    level = envs.log_level()
    if level == "NOTSET":
        return
    root = logging.getLogger("octavo")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
