"""Which model class serves which Hugging Face architecture name (``config.architectures``).

Built-in models register through :func:`register_builtin_models`, plugins through the
``octavo_register_models`` hook; both call :meth:`ModelRegistry.register`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

RegisterModel = Callable[[str, type], None]


class ModelRegistry:
    """Maps architecture names (e.g. ``"LlamaForCausalLM"``) to model classes."""

    def __init__(self) -> None:
        self._models: dict[str, type] = {}

    def register(self, architecture: str, model_cls: type) -> None:
        """Serve ``architecture`` with ``model_cls``; a later registration replaces an earlier one."""
        if not isinstance(architecture, str) or not architecture:
            raise TypeError(f"architecture must be a non-empty str, got {architecture!r}")
        if not isinstance(model_cls, type):
            raise TypeError(f"model_cls for {architecture!r} must be a class, got {model_cls!r}")
        previous = self._models.get(architecture)
        if previous is not None and previous is not model_cls:
            logger.info(
                "model architecture %s: %s replaces %s",
                architecture, model_cls.__qualname__, previous.__qualname__,
            )
        self._models[architecture] = model_cls

    def resolve(self, architectures: list[str]) -> type:
        """The class of the first supported name in ``architectures`` (a config's list).

        Raises ``ValueError`` naming the architectures asked for and the supported ones.
        """
        for architecture in architectures or []:
            if architecture in self._models:
                return self._models[architecture]
        raise ValueError(
            f"Model architecture(s) [{', '.join(architectures or [])}] not supported by Octavo. "
            f"Supported: [{', '.join(self.supported())}]. "
            "A plugin can add one through the octavo_register_models hook."
        )

    def supported(self) -> list[str]:
        """Registered architecture names, sorted."""
        return sorted(self._models)


def register_builtin_models(register: RegisterModel) -> None:
    """Register Octavo's own model implementations through ``register(architecture, cls)``."""
    from octavo.model_executor.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
    from octavo.model_executor.models.llama import LlamaForCausalLM
    from octavo.model_executor.models.mistral import MistralForCausalLM
    from octavo.model_executor.models.mixtral import MixtralForCausalLM
    from octavo.model_executor.models.phi3 import Phi3ForCausalLM
    from octavo.model_executor.models.qwen2 import Qwen2ForCausalLM
    from octavo.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
    from octavo.model_executor.models.qwen3 import Qwen3ForCausalLM
    from octavo.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    register("LlamaForCausalLM", LlamaForCausalLM)
    register("MistralForCausalLM", MistralForCausalLM)
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
    register("MixtralForCausalLM", MixtralForCausalLM)
    register("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
    register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
    register("Gemma2ForCausalLM", Gemma2ForCausalLM)
    register("Gemma3ForCausalLM", Gemma3ForCausalLM)
    register("Phi3ForCausalLM", Phi3ForCausalLM)


def builtin_registry() -> ModelRegistry:
    """A fresh registry holding only the built-in models."""
    registry = ModelRegistry()
    register_builtin_models(registry.register)
    return registry
