"""Octavo's own torch model implementations and the registry that picks one per architecture."""

from octavo.model_executor.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from octavo.model_executor.models.llama import LlamaForCausalLM
from octavo.model_executor.models.mistral import MistralForCausalLM
from octavo.model_executor.models.mixtral import MixtralForCausalLM
from octavo.model_executor.models.phi3 import Phi3ForCausalLM
from octavo.model_executor.models.qwen2 import Qwen2ForCausalLM
from octavo.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from octavo.model_executor.models.qwen3 import Qwen3ForCausalLM
from octavo.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from octavo.model_executor.models.registry import (
    ModelRegistry,
    builtin_registry,
    register_builtin_models,
)

__all__ = [
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "ModelRegistry",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "builtin_registry",
    "register_builtin_models",
]
