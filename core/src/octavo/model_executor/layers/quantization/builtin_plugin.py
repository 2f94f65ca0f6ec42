"""Octavo's own quantization methods, registered through the same hook as a plugin's.

``tryfirst``: pluggy calls it before every plugin's implementation, and a later registration
of a name replaces an earlier one, so a plugin can replace a built-in method as well as add
new ones.
"""

from __future__ import annotations

from collections.abc import Callable

from octavo.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def octavo_register_quantization_methods(register: Callable[[str, type], None]) -> None:
    from octavo.model_executor.layers.quantization import builtin_methods

    for config_cls in builtin_methods():
        register(config_cls.name, config_cls)
