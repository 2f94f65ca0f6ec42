"""The Hugging Face config and tokenizer of a GGUF file, built from Octavo's one parse of it.

``transformers`` can build both from a ``gguf_file=`` argument, but it reads the file again
each time, and for Llama/Qwen2/Qwen3 its config path goes through ``gguf.GGUFReader``
(seconds for a 49k-token vocabulary). Here the same transformers tables and converters are fed
the metadata that ``octavo.model_executor.loader.gguf_file.read_gguf`` already parsed:

- the config follows ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` (its
  ``GGUF_TO_TRANSFORMERS_MAPPING`` key renames and ``GGUF_CONFIG_DEFAULTS_MAPPING``);
- the tokenizer follows ``transformers.integrations.gguf`` (``get_gguf_tokenizer`` then
  ``convert_gguf_tokenizer``), handed to the class ``AutoTokenizer`` would pick.

Where the installed transformers lacks those pieces, or the architecture is not one Octavo
runs, both fall back to transformers' own ``from_pretrained(..., gguf_file=...)`` (slower,
same result). ``tests/model_executor/test_gguf_hf.py`` checks both against transformers.
"""

from __future__ import annotations

import logging
from typing import Any

from octavo.model_executor.loader.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# Architectures built here (the ones octavo.model_executor.loader.gguf_loader loads).
_FAST_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def gguf_hf_config(gguf_file: GGUFFile) -> Any:
    """The ``transformers`` config that ``AutoConfig.from_pretrained(gguf_file=...)`` gives."""
    from transformers import AutoConfig

    config_dict = None
    if gguf_file.architecture in _FAST_ARCHITECTURES:
        config_dict = _config_dict(gguf_file)
    if config_dict is None:
        return AutoConfig.from_pretrained(str(gguf_file.path.parent), gguf_file=gguf_file.path.name)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    config._name_or_path = str(gguf_file.path.parent)
    return config


def gguf_hf_tokenizer(gguf_file: GGUFFile, hf_config: Any) -> Any:
    """The tokenizer that ``AutoTokenizer.from_pretrained(gguf_file=...)`` gives."""
    built = None
    if gguf_file.architecture in _FAST_ARCHITECTURES:
        built = _tokenizer(gguf_file, hf_config)
    if built is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gguf_file.path.parent),
                                             gguf_file=gguf_file.path.name)
    return built


def _config_dict(gguf_file: GGUFFile) -> dict[str, Any] | None:
    """``load_gguf_checkpoint(path, return_tensors=False)["config"]`` from parsed metadata."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING
    except ImportError:
        return None
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING
    except ImportError:
        GGUF_CONFIG_DEFAULTS_MAPPING = {}  # older transformers
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    metadata = gguf_file.metadata
    architecture = gguf_file.architecture
    # transformers compares the list of names with "mistral" (llama.cpp calls Mistral "llama").
    names = [metadata["general.name"]] if "general.name" in metadata else []
    updated = "mistral" if "llama" in architecture and "mistral" in names else architecture
    config: dict[str, Any] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in gguf_file.tensors),
    }
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated,
                                                GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for gguf_key, value in metadata.items():
        prefix, _, config_key = gguf_key.replace(architecture, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers unwraps one-element arrays
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        renamed = renames.get(prefix, {}).get(config_key)
        if config_key in renames.get(prefix, {}) and renamed not in (None, -1):
            config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    return config


def _tokenizer(gguf_file: GGUFFile, hf_config: Any) -> Any | None:
    """``get_gguf_tokenizer`` + ``convert_gguf_tokenizer`` of transformers' GGUF integration on
    the parsed metadata, handed to the tokenizer class ``AutoTokenizer`` picks for the model."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
        from transformers.models.auto.tokenization_auto import (
            TOKENIZER_MAPPING_NAMES,
            tokenizer_class_from_name,
        )
    except ImportError:
        return None
    metadata = gguf_file.metadata
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in names.items()
                if f"tokenizer.{key}" in metadata}
        for group, names in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"GGUF file {str(gguf_file.path)!r} has no tokenizer "
                         "(tokenizer.ggml.tokens is missing)")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # As transformers: llama.cpp adds BOS to a sentencepiece vocabulary unless told not to.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(gguf_file.architecture, tokenizer_dict)
    class_name = TOKENIZER_MAPPING_NAMES.get(hf_config.model_type) or "TokenizersBackend"
    tokenizer_cls = tokenizer_class_from_name(class_name)
    if tokenizer_cls is None:
        return None
    return tokenizer_cls(tokenizer_object=backend, name_or_path=str(gguf_file.path.parent),
                         **tokenizer_config, **extra)
