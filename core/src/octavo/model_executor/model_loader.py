"""Build the model class for a config and fill it with weights from disk."""

from __future__ import annotations

import logging
import time

import pluggy
import torch

from octavo.attention.base import AttentionBackend
from octavo.config import ModelConfig
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.gguf_quantized import gguf_kernels_for, quantize_gguf_layers

logger = logging.getLogger(__name__)


def resolve_model_class(model_config: ModelConfig, pm: pluggy.PluginManager) -> type:
    """The registered class for the model's architecture (built-ins and plugins alike)."""
    from octavo.model_executor.models.registry import ModelRegistry

    registry = ModelRegistry()
    pm.hook.octavo_register_models(register=registry.register)
    return registry.resolve(model_config.architectures)


def iterate_weights(model_config: ModelConfig, lazy: bool = False,
                    exclude: frozenset[str] = frozenset()):
    """(HF name, tensor) pairs from the GGUF file or the safetensors folder.

    :param lazy: safetensors weights come as ``CheckpointTensor`` views that read only the part
        a rank asks for (GGUF tensors are dequantized whole, one at a time).
    :param exclude: GGUF tensors not to read (kept in their blocks by ``gguf_quantized``).
    """
    if model_config.gguf_file is not None:
        from octavo.model_executor.loader.gguf_loader import iterate_gguf_weights

        return iterate_gguf_weights(model_config.gguf_file, exclude)
    from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights

    return iterate_safetensors_weights(model_config.model_dir, lazy=lazy)


def build_model(
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    device: torch.device,
    pm: pluggy.PluginManager,
    parallel: ParallelState | None = None,
) -> torch.nn.Module:
    """The model class for ``model_config`` instantiated on ``device`` in its dtype, with
    uninitialised parameters (this rank's part of them when split)."""
    model_cls = resolve_model_class(model_config, pm)
    parallel = parallel or ParallelState.single()
    kwargs = {}
    if getattr(model_cls, "supports_parallel", False):
        kwargs["parallel"] = parallel
    elif parallel.ranks.world_size > 1:
        raise ValueError(
            f"{model_cls.__qualname__} (architecture {model_config.architectures}) cannot be "
            "split over devices: run it with tensor_parallel_size=1 and pipeline_parallel_size=1"
        )
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            return model_cls(model_config.hf_config, attn_backend, **kwargs)
    finally:
        torch.set_default_dtype(previous_dtype)


def load_model(
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    device: torch.device,
    pm: pluggy.PluginManager,
    parallel: ParallelState | None = None,
) -> torch.nn.Module:
    """Instantiate the model on ``device`` in ``model_config.dtype`` and fill its weights: from
    the checkpoint, or random ones with ``load_format="dummy"``."""
    start = time.perf_counter()
    model = build_model(model_config, attn_backend, device, pm, parallel)
    model_cls = type(model)
    if model_config.load_format == "dummy":
        fill_dummy_weights(model, seed=model_config.seed)
    else:
        kept_quantized: frozenset[str] = frozenset()
        gguf_kernels = gguf_kernels_for(device.type) if model_config.gguf_file else None
        if gguf_kernels is not None:  # GGUF blocks kept as they are (#18, interim seam)
            kept_quantized = quantize_gguf_layers(model, model_config.gguf_file, gguf_kernels,
                                                  model_config.dtype)
        model.load_weights(iterate_weights(
            model_config, lazy=getattr(model_cls, "lazy_weights", False), exclude=kept_quantized))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    num_bytes = sum(t.numel() * t.element_size()
                    for t in [*model.parameters(), *model.buffers()])
    logger.info(
        "weights: loaded %s (%s, %.1fM float parameters, %s; %.1f MiB in all) in %.2f s",
        model_config.model, model_cls.__name__, num_params / 1e6, model_config.dtype_name,
        num_bytes / 2**20, time.perf_counter() - start,
    )
    return model


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (``load_format="dummy"``): N(0, 0.02) for matrices
    and embeddings, 1 for norm weights, 0 for biases; each rank fills only what it holds. The
    outputs mean nothing; the shapes, memory and speed are the real model's."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:  # drawn where the parameter lives: a large model's weights never cross the bus
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])
