"""Hook implementations of the GPT-2 plugin (entry point ``octavo = gpt2``).

Cheap to import: the model module loads only when a model is being resolved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from octavo.hookspecs import hookimpl

ARCHITECTURE = "GPT2LMHeadModel"


@hookimpl
def octavo_register_models(register: Callable[[str, type[Any]], None]) -> None:
    from octavo_gpt2.model import GPT2LMHeadModel

    register(ARCHITECTURE, GPT2LMHeadModel)
