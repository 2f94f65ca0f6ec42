"""``BackendPlugin``: a whole hardware backend's hook surface from one declaration.

Every backend answers the same five hooks the same way: register its ``Backend``, and for its
own name (``None`` for any other) import and return its attention implementation, its worker
class, its KV-cache memory sizing and what moves its KV blocks (by default the core's
``octavo.worker.kv_block_mover``). A backend's ``plugin.py`` therefore only declares::

    plugin = BackendPlugin(
        Backend(name="mydev", ...),
        attention="octavo_mydev.attention:make_attention_backend",
        worker="octavo_mydev.worker:MyDevWorker",
        kv_cache_memory="octavo_mydev.memory:available_kv_cache_memory",
        quant_kernels="octavo_mydev.quant:quant_kernels",  # optional
    )

and its entry point names the object (``mydev = "octavo_mydev.plugin:plugin"``). The pieces
are ``"module:attribute"`` references imported only when the backend is chosen, so discovery
stays cheap (no torch, no kernels). A separately installed plugin can still replace one piece
for this backend with a ``tryfirst`` hook implementation of its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from octavo.backends.backend import Backend
from octavo.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from octavo.attention.base import AttentionBackend
    from octavo.config import CacheConfig, ModelConfig, ParallelConfig
    from octavo.worker.worker import Worker


def import_reference(reference: str) -> Any:
    """The object a ``"package.module:attribute"`` reference names."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected 'package.module:attribute', got {reference!r}")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except AttributeError:
        raise ImportError(f"{module_name!r} has no attribute {attribute!r} ({reference})") from None


# The mover every built-in backend uses (see octavo.worker.kv_block_mover).
DEFAULT_KV_BLOCK_MOVER = "octavo.worker.kv_block_mover:default_kv_block_mover"


class BackendPlugin:
    """The registration and selection hooks of one backend (see the module docstring).

    :param backend: the description ``octavo_register_backends`` registers.
    :param attention: reference to ``f(model_config, cache_config) -> AttentionBackend``.
    :param worker: reference to the ``octavo.worker.worker.Worker`` subclass.
    :param kv_cache_memory: reference to ``f(worker, cache_config) -> int`` (bytes the KV
        cache may take on the worker's device).
    :param quant_kernels: optional reference to ``f(method) -> object | None``: the backend's
        kernels for a quantization method (``octavo_quant_kernels``).
    :param kv_block_mover: reference to ``f(attn_backend, device) -> KVBlockMover`` (swaps and
        copies of whole KV blocks; the default is the core's batched torch mover).
    """

    def __init__(
        self, backend: Backend, *, attention: str, worker: str, kv_cache_memory: str,
        kv_block_mover: str = DEFAULT_KV_BLOCK_MOVER,
        quant_kernels: str | None = None,
    ) -> None:
        references = [("attention", attention), ("worker", worker),
                      ("kv_cache_memory", kv_cache_memory), ("kv_block_mover", kv_block_mover)]
        if quant_kernels is not None:
            references.append(("quant_kernels", quant_kernels))
        for name, reference in references:
            if ":" not in reference:
                raise ValueError(
                    f"BackendPlugin({backend.name!r}): {name} must be a 'module:attribute' "
                    f"reference, got {reference!r}"
                )
        self.backend = backend
        self.attention = attention
        self.worker = worker
        self.kv_cache_memory = kv_cache_memory
        self.kv_block_mover = kv_block_mover
        self.quant_kernels = quant_kernels

    def __repr__(self) -> str:
        return f"BackendPlugin({self.backend.name!r})"

    @hookimpl
    def octavo_register_backends(self, register: Callable[[Backend], None]) -> None:
        register(self.backend)

    def _piece(self, backend: str, reference: str) -> Any:
        """The object ``reference`` names when ``backend`` is this one, else ``None``."""
        return import_reference(reference) if backend == self.backend.name else None

    @hookimpl
    def octavo_attention_backend(
        self, backend: str, model_config: ModelConfig, cache_config: CacheConfig
    ) -> AttentionBackend | None:
        make = self._piece(backend, self.attention)
        return None if make is None else make(model_config, cache_config)

    @hookimpl
    def octavo_available_kv_cache_memory(
        self, backend: str, worker: Worker, cache_config: CacheConfig
    ) -> int | None:
        measure = self._piece(backend, self.kv_cache_memory)
        return None if measure is None else int(measure(worker, cache_config))

    @hookimpl
    def octavo_worker_class(
        self, backend: str, parallel_config: ParallelConfig
    ) -> type[Worker] | None:
        return self._piece(backend, self.worker)

    @hookimpl
    def octavo_kv_block_mover(
        self, backend: str, attn_backend: AttentionBackend, device: torch.device
    ) -> Any:
        make = self._piece(backend, self.kv_block_mover)
        return None if make is None else make(attn_backend, device)

    @hookimpl
    def octavo_quant_kernels(self, backend: str, method: str) -> Any | None:
        if self.quant_kernels is None:
            return None
        provide = self._piece(backend, self.quant_kernels)
        return None if provide is None else provide(method)
