"""Hook implementation of the FlexAttention plugin (entry point ``octavo = flex-attention``).

Replaces only the ``cpu`` backend's attention implementation (``tryfirst``, so pluggy asks this
hook before the backend's own); the cpu worker and KV-cache sizing still come from the cpu
backend. Opt-in: the hook answers only when ``OCTAVO_FLEX_ATTENTION`` turns it on (see
``octavo_flex_attention.envs``), so installing the package changes nothing by itself.

Cheap to import: torch's FlexAttention loads only when an engine picks it.
"""

from __future__ import annotations

import logging

from octavo.hookspecs import hookimpl

from octavo_flex_attention.envs import FLEX_ATTENTION, flex_attention_mode

# Under the ``octavo`` logger tree, so the engine's logging configuration shows it.
logger = logging.getLogger("octavo.plugins.flex_attention")

BACKEND_NAME = "cpu"

# Modes already announced in this process (the info line is logged once per mode).
_announced: set[str] = set()


@hookimpl(tryfirst=True)
def octavo_attention_backend(backend, model_config, cache_config):
    if backend != BACKEND_NAME:
        return None
    mode = flex_attention_mode()
    if mode is None:
        return None  # off: the cpu backend's own kernels answer
    from octavo_flex_attention.attention import FlexAttentionBackend

    if mode not in _announced:
        _announced.add(mode)
        logger.info(
            "flex-attention plugin: cpu attention runs on torch FlexAttention (%s; %s=%s)",
            "torch.compile" if mode == "compile" else "eager, unfused", FLEX_ATTENTION, mode,
        )
    return FlexAttentionBackend(compiled=mode == "compile")
