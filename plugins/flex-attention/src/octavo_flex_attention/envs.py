"""Every environment variable this plugin reads, declared in this one place.

| variable | meaning |
|---|---|
| ``OCTAVO_FLEX_ATTENTION`` | unset, empty or ``0``: off (the cpu backend keeps its own kernels); ``1`` or ``eager``: cpu attention runs on FlexAttention without ``torch.compile``; ``compile``: on ``torch.compile(flex_attention)`` (fused C++ kernel, tens of seconds of compilation per process) |

The variable is read each time an engine picks its attention implementation, so one process
can build engines with and without the plugin. ``OCTAVO_DISABLE_PLUGINS=flex-attention`` keeps
the plugin from loading at all.
"""

from __future__ import annotations

import os
from typing import Literal

FLEX_ATTENTION = "OCTAVO_FLEX_ATTENTION"

FlexMode = Literal["eager", "compile"]

_VALUES: dict[str, FlexMode | None] = {
    "": None, "0": None, "off": None, "false": None,
    "1": "eager", "on": "eager", "true": "eager", "eager": "eager",
    "compile": "compile",
}


def flex_attention_mode() -> FlexMode | None:
    """``"eager"``, ``"compile"``, or ``None`` when the override is off.

    Raises ``ValueError`` naming the variable, its value and the valid choices.
    """
    raw = os.environ.get(FLEX_ATTENTION, "").strip().lower()
    if raw not in _VALUES:
        raise ValueError(
            f"{FLEX_ATTENTION}={os.environ[FLEX_ATTENTION]!r} is not understood; use one of "
            "0 (off), 1 or eager, compile"
        )
    return _VALUES[raw]
