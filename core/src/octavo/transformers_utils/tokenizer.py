"""Tokenizer and end-of-sequence ids through ``transformers`` (folders and GGUF files)."""

from __future__ import annotations

import logging
import time
from typing import Any

from octavo.config import ModelConfig

logger = logging.getLogger(__name__)


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The model's ``transformers`` tokenizer: from ``model_config.tokenizer`` when set, else
    from the model folder, or built from GGUF metadata (sharing the process's one parse of the
    file)."""
    start = time.perf_counter()
    if model_config.tokenizer is None and model_config.gguf_file is not None:
        from octavo.model_executor.loader.gguf_file import read_gguf
        from octavo.model_executor.loader.gguf_hf import gguf_hf_tokenizer

        tokenizer = gguf_hf_tokenizer(read_gguf(model_config.gguf_file), model_config.hf_config)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer or model_config.model_dir,
            trust_remote_code=model_config.trust_remote_code,
        )
    logger.info("tokenizer: %s, %d tokens, loaded in %.2f s", type(tokenizer).__name__,
                len(tokenizer), time.perf_counter() - start)
    return tokenizer


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
