"""Sampling defaults from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

A model's authors often ship the settings it is meant to be sampled with (Llama 3's
``temperature: 0.6, top_p: 0.9``, Qwen's ``top_k: 20, repetition_penalty: 1.05``). With
``auto`` (the default, as in vLLM) those fields become the defaults of every request that does
not set them itself; ``vllm`` ignores the file (Octavo's own defaults); a folder path reads the
``generation_config.json`` found there instead of the model's. The model's EOS ids are taken
from the file whatever the mode (``octavo.engine.tokenizer``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# The fields of generation_config.json used as sampling defaults (``SamplingParams`` names).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE_NAME = "generation_config.json"


def load_sampling_defaults(model_dir: Path, mode: str) -> dict[str, float | int]:
    """The sampling defaults ``mode`` (``"auto"``, ``"vllm"`` or a folder) gives the model
    in ``model_dir``: the fields of ``SAMPLING_DEFAULT_FIELDS`` the file sets (not null).

    Raises ``ValueError`` for a folder that does not exist or has no ``generation_config.json``,
    and for a file that is not a JSON object or sets a field to a value of the wrong type.
    """
    if mode == "vllm":
        return {}
    if mode == "auto":
        path = Path(model_dir) / FILE_NAME
        if not path.is_file():
            return {}
    else:
        folder = Path(mode).expanduser()
        if not folder.is_dir():
            raise ValueError(
                f"--generation-config {mode!r} is neither 'auto', 'vllm' nor a folder; give a "
                f"folder holding {FILE_NAME}")
        path = folder / FILE_NAME
        if not path.is_file():
            raise ValueError(f"--generation-config {mode!r}: the folder has no {FILE_NAME}")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    defaults: dict[str, float | int] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
        defaults[name] = int(value) if name == "top_k" else float(value)
    if defaults:
        logger.info("sampling defaults from %s (used where a request does not set them): %s",
                    path, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
