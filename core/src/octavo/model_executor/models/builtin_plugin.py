"""Octavo's own architectures, registered through the same hook as third-party ones.

The implementation is ``tryfirst``: pluggy calls it before every plugin's, and a later
``register`` of a name replaces an earlier one, so an installed plugin can replace a built-in
architecture (say, its own ``LlamaForCausalLM``) as well as add new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from octavo.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def octavo_register_models(register: Callable[[str, type[Any]], None]) -> None:
    from octavo.model_executor.models.registry import register_builtin_models

    register_builtin_models(register)
