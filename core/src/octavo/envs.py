"""Every environment variable Octavo reads, declared in this one place.

| variable | meaning |
|---|---|
| ``OCTAVO_LOG_LEVEL`` | level of the ``octavo`` logger (DEBUG, INFO, WARNING, ...; NOTSET = leave logging alone) |
| ``OCTAVO_PLUGINS`` | comma-separated allow-list of entry-point names to load (unset = all; empty = none) |
| ``OCTAVO_DISABLE_PLUGINS`` | comma-separated entry-point names never to load |
| ``OCTAVO_TRACE_HOOKS`` | ``1`` logs every hook call and its result at DEBUG level on ``octavo.hooks`` |
"""

import os


def log_level() -> str:
    return os.environ.get("OCTAVO_LOG_LEVEL", "INFO").upper()


def plugin_allow_list() -> set[str] | None:
    """Entry-point names allowed to load, or ``None`` when every installed plugin may load."""
    raw = os.environ.get("OCTAVO_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def plugin_block_list() -> set[str]:
    raw = os.environ.get("OCTAVO_DISABLE_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def trace_hooks() -> bool:
    return os.environ.get("OCTAVO_TRACE_HOOKS", "0") not in ("", "0", "false", "False")
