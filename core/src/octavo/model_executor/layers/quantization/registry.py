"""Which quantization methods exist, and which one a model runs with.

Methods register through the ``octavo_register_quantization_methods`` hook (the built-in ones
too, ``octavo.model_executor.layers.quantization.builtin_plugin``). ``resolve_quantization``
turns ``--quantization`` and the checkpoint into one method name (or ``None``: dense weights);
``create_quantization_config`` builds that method's config for a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pluggy

from octavo.model_executor.layers.quantization.base import QuantizationConfig, QuantizationSource

logger = logging.getLogger(__name__)

#: ``--quantization none``: dense weights; for a GGUF file, dequantized while loading.
NO_QUANTIZATION = "none"

RegisterQuantization = Callable[[str, type[QuantizationConfig]], None]


class QuantizationRegistry:
    """Method name -> ``QuantizationConfig`` subclass."""

    def __init__(self) -> None:
        self._methods: dict[str, type[QuantizationConfig]] = {}

    def register(self, name: str, config_cls: type[QuantizationConfig]) -> None:
        """Provide method ``name``; a later registration of a name replaces an earlier one."""
        if not isinstance(name, str) or not name or name == NO_QUANTIZATION:
            raise TypeError(f"a quantization method needs a non-empty name other than "
                            f"{NO_QUANTIZATION!r}, got {name!r}")
        if not (isinstance(config_cls, type) and issubclass(config_cls, QuantizationConfig)):
            raise TypeError(f"quantization method {name!r} must be a subclass of "
                            f"QuantizationConfig, got {config_cls!r}")
        previous = self._methods.get(name)
        if previous is not None and previous is not config_cls:
            logger.info("quantization method %s: %s replaces %s", name,
                        config_cls.__qualname__, previous.__qualname__)
        self._methods[name] = config_cls

    def get(self, name: str) -> type[QuantizationConfig]:
        if name not in self._methods:
            raise ValueError(f"unknown quantization method {name!r}; known: "
                             f"{', '.join(self.names() + [NO_QUANTIZATION])}")
        return self._methods[name]

    def names(self) -> list[str]:
        return sorted(self._methods)

    def reading_checkpoint_method(self, quant_method: str) -> str | None:
        """The registered method that reads checkpoints of ``quant_method``, if any."""
        for name, config_cls in sorted(self._methods.items()):
            if quant_method in config_cls.checkpoint_methods:
                return name
        return None

    def reading_gguf(self) -> str | None:
        for name, config_cls in sorted(self._methods.items()):
            if config_cls.reads_gguf:
                return name
        return None


def build_quantization_registry(pm: pluggy.PluginManager) -> QuantizationRegistry:
    """Every method the built-ins and the installed plugins provide."""
    registry = QuantizationRegistry()
    pm.hook.octavo_register_quantization_methods(register=registry.register)
    return registry


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint's config.json as a dict (None: none)."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    return dict(config)


def resolve_quantization(
    requested: str | None,
    hf_config: Any,
    gguf_file: Path | None,
    registry: QuantizationRegistry,
    backend_methods: Sequence[str],
) -> str | None:
    """The method the model runs with: a registered name, or ``None`` for dense weights.

    - ``requested`` unset: the checkpoint's own method (its ``quantization_config``); for a GGUF
      file the GGUF method when the backend runs it (``backend_methods``), else dense weights
      dequantized while loading; ``None`` for a dense checkpoint.
    - ``"none"``: dense weights; only a GGUF file can be dequantized while loading.
    - a name: must match the checkpoint's method, or quantize a dense checkpoint while loading.

    ``ValueError`` (one line: what was asked, what the checkpoint is, what to do) otherwise.
    Whether the backend runs the method is checked after, by ``check_config``.
    """
    quant_config = checkpoint_quant_config(hf_config)
    stored: str | None = None
    if gguf_file is not None:
        stored = registry.reading_gguf()
    elif quant_config is not None:
        quant_method = str(quant_config.get("quant_method", "")).lower()
        stored = registry.reading_checkpoint_method(quant_method)
        if stored is None:
            raise ValueError(
                f"the checkpoint is quantized with {quant_method or 'an unnamed method'!r}, "
                "which no installed quantization method reads (known: "
                f"{', '.join(registry.names())}); use a checkpoint in one of those formats")
    if requested is None:
        if gguf_file is not None and stored not in backend_methods:
            logger.info("GGUF weights are dequantized while loading: the backend runs no GGUF "
                        "kernels (it supports: %s)", ", ".join(backend_methods) or "none")
            return None
        return stored
    if requested == NO_QUANTIZATION:
        if quant_config is not None and gguf_file is None:
            raise ValueError(
                f"--quantization none was given, but the checkpoint's weights are stored "
                f"quantized ({stored}); run it with --quantization {stored} or leave the option "
                "unset")
        return None
    config_cls = registry.get(requested)
    if stored is not None:
        if requested != stored:
            raise ValueError(
                f"--quantization {requested} was given, but the checkpoint is quantized with "
                f"{stored}; use --quantization {stored} or leave the option unset")
        return requested
    if not config_cls.quantizes_dense_checkpoints:
        raise ValueError(
            f"--quantization {requested} needs a checkpoint quantized with it (a "
            f"{'/'.join(config_cls.checkpoint_methods) or requested} checkpoint); this one has "
            "dense weights. Methods that quantize dense weights while loading: "
            f"{', '.join(n for n in registry.names() if registry.get(n).quantizes_dense_checkpoints) or 'none'}")
    return requested


def create_quantization_config(
    name: str, hf_config: Any, gguf_file: Path | None, registry: QuantizationRegistry,
    kernels: Any = None,
) -> QuantizationConfig:
    """Method ``name``'s config for this model, with the backend's ``kernels`` (or None)."""
    source = QuantizationSource(checkpoint_quant_config(hf_config), gguf_file)
    config = registry.get(name).from_source(source)
    config.kernels = kernels
    return config
