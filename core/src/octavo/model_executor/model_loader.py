"""Build the model class for a config and fill it with weights from disk."""

from __future__ import annotations

import logging
import time
from typing import Any

import pluggy
import torch

from octavo.attention.base import AttentionBackend
from octavo.config import ModelConfig
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers.quantization.base import (
    LinearShape,
    QuantizationConfig,
    UnquantizedLinearMethod,
)

logger = logging.getLogger(__name__)


def resolve_model_class(model_config: ModelConfig, pm: pluggy.PluginManager) -> type:
    """The registered class for the model's architecture (built-ins and plugins alike)."""
    from octavo.model_executor.models.registry import ModelRegistry

    registry = ModelRegistry()
    pm.hook.octavo_register_models(register=registry.register)
    return registry.resolve(model_config.architectures)


def iterate_weights(model_config: ModelConfig, lazy: bool = False):
    """(HF name, tensor) pairs from the GGUF file or the safetensors folder.

    :param lazy: safetensors weights come as ``CheckpointTensor`` views that read only the part
        a rank asks for. GGUF tensors are dequantized whole, one at a time, unless the model
        keeps them quantized (``quantization="gguf"``): then quantized tensors come as
        ``GGUFBlocks`` views of their blocks, dequantized only by a dense parameter's loader.
    """
    if model_config.gguf_file is not None:
        from octavo.model_executor.loader.gguf_loader import iterate_gguf_weights

        return iterate_gguf_weights(model_config.gguf_file,
                                    keep_quantized=model_config.quantization == "gguf")
    from octavo.model_executor.loader.safetensors_loader import iterate_safetensors_weights

    return iterate_safetensors_weights(model_config.model_dir, lazy=lazy)


def quantization_config_for(model_config: ModelConfig, pm: pluggy.PluginManager,
                            backend: str | None) -> QuantizationConfig | None:
    """The model's quantization method config (None: dense weights), holding the kernels
    ``backend`` provides for it (``octavo_quant_kernels``), if any."""
    if model_config.quantization is None:
        return None
    from octavo.model_executor.layers.quantization.registry import (
        build_quantization_registry,
        create_quantization_config,
    )

    kernels = None
    if backend is not None:
        kernels = pm.hook.octavo_quant_kernels(backend=backend, method=model_config.quantization)
    config = create_quantization_config(
        model_config.quantization, model_config.hf_config, model_config.gguf_file,
        build_quantization_registry(pm), kernels)
    logger.info("quantization: %s%s", config.describe(),
                f" (kernels from backend {backend})" if kernels is not None else "")
    return config


def build_model(
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    device: torch.device,
    pm: pluggy.PluginManager,
    parallel: ParallelState | None = None,
    backend: str | None = None,
) -> torch.nn.Module:
    """The model class for ``model_config`` instantiated on ``device`` in its dtype, with
    uninitialised parameters (this rank's part of them when split). ``backend`` (the selected
    backend's name) is asked for the kernels of the model's quantization method."""
    model_cls = resolve_model_class(model_config, pm)
    parallel = parallel or ParallelState.single()
    kwargs: dict[str, Any] = {}
    if getattr(model_cls, "supports_parallel", False):
        kwargs["parallel"] = parallel
    elif parallel.ranks.world_size > 1:
        raise ValueError(
            f"{model_cls.__qualname__} (architecture {model_config.architectures}) cannot be "
            "split over devices: run it with tensor_parallel_size=1 and pipeline_parallel_size=1"
        )
    if getattr(model_cls, "accepts_max_model_len", False):
        kwargs["max_model_len"] = model_config.max_model_len
    if model_config.quantization is not None:
        if not getattr(model_cls, "supports_quantization", False):
            raise ValueError(
                f"{model_cls.__qualname__} (architecture {model_config.architectures}) cannot "
                f"run quantized weights ({model_config.quantization}); use a dense checkpoint")
        kwargs["quant_config"] = quantization_config_for(model_config, pm, backend)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_cls(model_config.hf_config, attn_backend, **kwargs)
            if kwargs.get("quant_config") is not None:
                _quantize_embeddings(model, kwargs["quant_config"])
            return model
    finally:
        torch.set_default_dtype(previous_dtype)


def _quantize_embeddings(model: torch.nn.Module, quant_config: QuantizationConfig) -> None:
    """Give each token embedding / LM head the method's ``EmbeddingMethod``, where it has one
    (one rank only: a split vocabulary stays dense)."""
    from octavo.model_executor.layers.vocab import VocabParallelEmbedding

    for path, module in model.named_modules():  # a tied LM head is the embedding: once
        if not isinstance(module, VocabParallelEmbedding) or module.parallel.tp_size != 1:
            continue
        method = quant_config.embedding_method(path, module.rows_per_rank,
                                               module.weight.shape[1])
        if method is not None:
            method.create_weights(module, LinearShape(
                input_size=module.weight.shape[1], output_sizes=(module.rows_per_rank,),
                full_input_size=module.weight.shape[1], input_start=0,
                params_dtype=module.weight.dtype))
            module.quant_method = method


def load_model(
    model_config: ModelConfig,
    attn_backend: AttentionBackend,
    device: torch.device,
    pm: pluggy.PluginManager,
    parallel: ParallelState | None = None,
    backend: str | None = None,
) -> torch.nn.Module:
    """Instantiate the model on ``device`` in ``model_config.dtype`` and fill its weights: from
    the checkpoint, or random ones with ``load_format="dummy"``; then let each quantized layer
    convert what it loaded (``LinearMethod.process_weights_after_loading``)."""
    start = time.perf_counter()
    model = build_model(model_config, attn_backend, device, pm, parallel, backend)
    model_cls = type(model)
    if model_config.load_format == "dummy":
        fill_dummy_weights(model, seed=model_config.seed)
    else:
        model.load_weights(
            iterate_weights(model_config, lazy=getattr(model_cls, "lazy_weights", False)))
    process_weights_after_loading(model)
    model.eval()
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "weights: loaded %s (%s, %.2f GiB in memory, %s%s) in %.2f s",
        model_config.model, model_cls.__name__, num_bytes / 2**30, model_config.dtype_name,
        f", {model_config.quantization}" if model_config.quantization else "",
        time.perf_counter() - start,
    )
    return model


@torch.no_grad()
def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Give every layer's quantization method its turn once all weights are in."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (``load_format="dummy"``): N(0, 0.02) for matrices
    and embeddings, 1 for norm weights, 0 for biases; each rank fills only what it holds. The
    outputs mean nothing; the shapes, memory and speed are the real model's."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        return generators[device]

    quantized: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, UnquantizedLinearMethod):
            method.fill_dummy_weights(module, generator(next(module.parameters()).device))
            quantized.update(id(p) for n, p in module.named_parameters(recurse=False)
                             if n != "bias")
    for name, param in model.named_parameters():
        if id(param) in quantized:
            continue
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:  # drawn where the parameter lives: a large model's weights never cross the bus
            param.normal_(0.0, 0.02, generator=generator(param.device))
