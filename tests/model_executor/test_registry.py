"""The model registry: built-in architectures, plugin registration, the unsupported error."""

from __future__ import annotations

import pytest
from octavo.model_executor.models import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    ModelRegistry,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    builtin_registry,
)


def test_builtin_architectures_resolve() -> None:
    registry = builtin_registry()
    assert registry.supported() == [
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
        "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    ]
    assert registry.resolve(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert registry.resolve(["MistralForCausalLM"]) is MistralForCausalLM
    assert registry.resolve(["Qwen2ForCausalLM"]) is Qwen2ForCausalLM
    assert registry.resolve(["Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert registry.resolve(["MixtralForCausalLM"]) is MixtralForCausalLM
    assert registry.resolve(["Qwen2MoeForCausalLM"]) is Qwen2MoeForCausalLM
    assert registry.resolve(["Qwen3MoeForCausalLM"]) is Qwen3MoeForCausalLM
    assert registry.resolve(["Gemma2ForCausalLM"]) is Gemma2ForCausalLM
    assert registry.resolve(["Gemma3ForCausalLM"]) is Gemma3ForCausalLM
    assert registry.resolve(["Phi3ForCausalLM"]) is Phi3ForCausalLM
    # The first supported name of a config's list wins.
    assert registry.resolve(["FancyForCausalLM", "Qwen2ForCausalLM"]) is Qwen2ForCausalLM


def test_unsupported_architecture_error_text() -> None:
    with pytest.raises(ValueError) as error:
        builtin_registry().resolve(["GPT2LMHeadModel", "FooForCausalLM"])
    assert str(error.value) == (
        "Model architecture(s) [GPT2LMHeadModel, FooForCausalLM] not supported by Octavo. "
        "Supported: [Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
        "MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3ForCausalLM, Qwen3MoeForCausalLM]. "
        "A plugin can add one through the octavo_register_models hook."
    )
    with pytest.raises(ValueError, match=r"Model architecture\(s\) \[\] not supported"):
        builtin_registry().resolve([])


def test_plugin_registration_adds_and_replaces() -> None:
    class MyModel(LlamaForCausalLM):
        pass

    registry = ModelRegistry()
    assert registry.supported() == []
    registry.register("MyForCausalLM", MyModel)
    registry.register("LlamaForCausalLM", MyModel)
    assert registry.resolve(["MyForCausalLM"]) is MyModel
    assert registry.resolve(["LlamaForCausalLM"]) is MyModel
    with pytest.raises(TypeError, match="must be a class"):
        registry.register("Bad", object())  # type: ignore[arg-type]
