"""Octavo's own torch model implementations and the registry that picks one per architecture."""

from octavo.model_executor.models.llama import LlamaForCausalLM
from octavo.model_executor.models.mistral import MistralForCausalLM
from octavo.model_executor.models.qwen2 import Qwen2ForCausalLM
from octavo.model_executor.models.qwen3 import Qwen3ForCausalLM
from octavo.model_executor.models.registry import (
    ModelRegistry,
    builtin_registry,
    register_builtin_models,
)

__all__ = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "ModelRegistry",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "builtin_registry",
    "register_builtin_models",
]
