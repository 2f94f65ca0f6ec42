"""Tokenizer and end-of-sequence ids through ``transformers`` (folders and GGUF files)."""

from __future__ import annotations

import logging
from typing import Any

from octavo.config import ModelConfig

logger = logging.getLogger(__name__)


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The model's ``transformers`` tokenizer (from the folder, or built from GGUF metadata)."""
    from transformers import AutoTokenizer

    if model_config.gguf_file is not None:
        return AutoTokenizer.from_pretrained(
            model_config.model_dir, gguf_file=model_config.gguf_file.name
        )
    return AutoTokenizer.from_pretrained(model_config.model_dir)


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> set[int]:
    """Every id that ends generation by default: generation_config.json, config, tokenizer."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    generation_config = model_config.model_dir / "generation_config.json"
    if model_config.gguf_file is None and generation_config.is_file():
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_config.model_dir).eos_token_id)
    add(getattr(model_config.hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids
