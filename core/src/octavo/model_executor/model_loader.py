"""Build the model class for a config and fill it with weights from disk."""

from __future__ import annotations

import logging
import time

import pluggy
import torch

from octavo.attention.base import AttentionBackend
from octavo.config import ModelConfig

logger = logging.getLogger(__name__)


def resolve_model_class(model_config: ModelConfig, pm: pluggy.PluginManager) -> type:
    """The registered class for the model's architecture (built-ins and plugins alike)."""
    from octavo.model_executor.models.registry import ModelRegistry

    registry = ModelRegistry()
    pm.hook.octavo_register_models(register=registry.register)
    return registry.resolve(model_config.architectures)


def iterate_weights(model_config: ModelConfig):
    """(HF name, tensor) pairs from the GGUF file or the safetensors folder."""
    if model_config.gguf_file is not None:
        from octavo.model_executor.loader.gguf_loader import iterate_gguf_weights

        return iterate_gguf_weights(model_config.gguf_file)
    from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights

    return iterate_safetensors_weights(model_config.model_dir)


def load_model(
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    device: torch.device,
    pm: pluggy.PluginManager,
) -> torch.nn.Module:
    """Instantiate the model on ``device`` in ``model_config.dtype`` and load its weights."""
    model_cls = resolve_model_class(model_config, pm)
    start = time.perf_counter()
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_cls(model_config.hf_config, attn_backend)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.load_weights(iterate_weights(model_config))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM parameters, %s) in %.1f s",
        model_config.model, model_cls.__name__, num_params / 1e6, model_config.dtype_name,
        time.perf_counter() - start,
    )
    return model
