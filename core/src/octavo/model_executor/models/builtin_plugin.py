"""Octavo's own architectures, registered through the same hook as third-party ones."""

from __future__ import annotations

from typing import Any, Callable

from octavo.hookspecs import hookimpl


@hookimpl
def octavo_register_models(register: Callable[[str, type[Any]], None]) -> None:
    from octavo.model_executor.models.registry import register_builtin_models

    register_builtin_models(register)
