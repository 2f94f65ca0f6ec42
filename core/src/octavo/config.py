"""The handful of typed configuration objects an engine is built from: plain data.

``EngineArgs`` (``octavo.engine.arg_utils``: the user-facing flat options of ``octavo.LLM``
and the CLI) resolves the model (``octavo.model_executor.model_files``) and the backend, and
builds one ``EngineConfig`` holding a ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``
and ``ParallelConfig``. Each dataclass checks its own values on construction, with a
``ValueError`` naming the bad one; nothing here reads files or probes devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from octavo.backends.backend import BackendCapabilities


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
    # Most top logprobs a request may ask for per token (logprobs, prompt_logprobs).
    max_logprobs: int = 20
    # Most completions one request may ask for (n).
    max_n: int = 128
    # "auto": the checkpoint's weights; "dummy": random weights of the config's shape, no
    # checkpoint read (benchmarks of shapes whose weights are not at hand).
    load_format: str = "auto"
    # Folder of the tokenizer to use instead of the model's own (None: the model's).
    tokenizer: Path | None = None
    # Let transformers run code shipped in the model/tokenizer folder (custom config/tokenizer).
    trust_remote_code: bool = False
    # Quantization method the weights run with (a registered name: "fp8", "awq", "gptq",
    # "gguf", ...; octavo.model_executor.layers.quantization), None for dense weights.
    quantization: str | None = None
    # Sampling defaults from the model's generation_config.json (temperature, top_p, top_k,
    # min_p, repetition_penalty) that a request uses for the fields it does not set; empty with
    # --generation-config vllm (see octavo.model_executor.generation_config).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # Name of the reasoning parser (octavo.reasoning) that splits the model's thinking from its
    # answer; None: the output is all answer.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"max_n must be a positive integer, got {self.max_n!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")

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

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window as the engine runs it: the checkpoint's window
        (``layer_sliding_windows``), or ``None`` where it does not bind because
        ``max_model_len`` fits in it (full and windowed attention then agree)."""
        return tuple(w if w is not None and w < self.max_model_len else None
                     for w in layer_sliding_windows(self.hf_config))

    @property
    def uses_sliding_window(self) -> bool:
        """Whether some layer's window is shorter than ``max_model_len``."""
        return any(w is not None for w in self.sliding_windows)

    @property
    def logits_soft_cap(self) -> float | None:
        """The attention logit soft cap the model applies (``attention_logit_soft_cap``)."""
        return attention_logit_soft_cap(self.hf_config)


# Model types whose transformers implementation ignores a set ``attn_logit_softcapping``.
_SOFT_CAP_IGNORED = ("gemma3", "gemma3_text")


def layer_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """The attention window of every layer of a ``transformers`` config (``None``: full).

    ``config.sliding_window`` applies to the layers ``config.layer_types`` marks
    ``"sliding_attention"`` (Gemma 2/3, Qwen2/3 past ``max_window_layers``), or to every layer
    when the config has no ``layer_types`` (Mistral, Phi-3); never when ``use_sliding_window``
    is false (Qwen).
    """
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(
            hf_config, "use_sliding_window", True) is False:
        # A plugin model's config may not name its layer count the transformers way.
        return (None,) * int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    num_layers = int(hf_config.num_hidden_layers)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None
                 for kind in list(layer_types)[:num_layers])


def attention_logit_soft_cap(hf_config: Any) -> float | None:
    """``config.attn_logit_softcapping`` where the architecture applies it (Gemma 2; Gemma 3's
    implementation ignores the field), else ``None``."""
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    if cap is None or getattr(hf_config, "model_type", None) in _SOFT_CAP_IGNORED:
        return None
    return float(cap)


# Where the weights come from (see ModelConfig.load_format).
LOAD_FORMATS = ("auto", "dummy")


#: Values of --kv-cache-dtype: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3")
#: stores them as float8 e4m3 with a per-tensor scale per layer (half of bf16's bytes).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache for ``--kv-cache-dtype cache_dtype``."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv cache dtype {cache_dtype!r}; use one of {KV_CACHE_DTYPES}")


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache: block size, prefix caching and how much memory it may take."""

    # Tokens per KV block.
    block_size: int = 16
    # Element type of the cache (--kv-cache-dtype, KV_CACHE_DTYPES): "auto" = the model's.
    cache_dtype: str = "auto"
    # Reuse KV blocks of identical prompt prefixes across requests.
    enable_prefix_caching: bool = True
    # Exact KV-cache size in bytes (wins over the fractions below).
    kv_cache_memory_bytes: int | None = None
    # KV-cache size in GiB on the CPU backend (None: $OCTAVO_CPU_KVCACHE_SPACE, else 4 GiB,
    # or half the host memory available if that is less; see octavo_cpu.memory).
    cpu_kv_cache_space: float | None = None
    # When set, the CPU backend gives the KV cache this share of the host memory available
    # after loading instead of a fixed size (so its size varies from run to run).
    cpu_kv_cache_fraction: float | None = None
    # Fraction of GPU memory the whole engine may use (GPU backends).
    gpu_memory_utilization: float = 0.9
    # Exact number of KV blocks (tests use it to force preemption); wins over memory sizing.
    num_gpu_blocks_override: int | None = None
    # The attention window of the model when every layer has one shorter than max_model_len
    # (else None): a request's blocks wholly before the window of its next token are freed.
    # Set from the model by EngineArgs; None turns that freeing off.
    sliding_window: int | None = None
    # Host memory (GiB per device) for KV blocks of requests preempted by swapping; only
    # allocated when SchedulerConfig.preemption_mode is "swap" (vLLM's --swap-space).
    swap_space: float = 4.0

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * 2**30)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            hint = " (e5m2 is not supported)" if self.cache_dtype == "fp8_e5m2" else ""
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.cache_dtype!r}{hint}; use --kv-cache-dtype fp8 for e4m3")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes!r}"
            )
        if self.cpu_kv_cache_space is not None and not self.cpu_kv_cache_space > 0:
            raise ValueError(
                f"cpu_kv_cache_space must be > 0 (GiB), got {self.cpu_kv_cache_space!r}"
            )
        if self.cpu_kv_cache_fraction is not None and not 0.0 < self.cpu_kv_cache_fraction <= 1.0:
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
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(
                f"sliding_window must be None or a positive integer, got {self.sliding_window!r}")
        if (isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float))
                or not self.swap_space >= 0):
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space!r}")


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
    # Schedule step N+1 while step N runs on the device (see octavo.engine_core.core).
    async_scheduling: bool = False
    # How a request preempted for lack of KV blocks gets its KV back: "recompute" (prompt and
    # generated tokens run again as a prompt) or "swap" (its blocks go to host memory and come
    # back; short requests are still recomputed, see octavo.scheduler.preemption).
    preemption_mode: str = "recompute"
    # Order of service: "fcfs" (arrival) or "priority" (a request's priority, lower first;
    # preemption takes the lowest priority first).
    scheduling_policy: str = "fcfs"
    # Streamed (DELTA) outputs: a request's first token goes out at once, then a delta only
    # once this many new tokens are waiting (or the request finished). 1: every step.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive integer (tokens), got "
                             f"{self.stream_interval!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                "max_num_batched_tokens must be a positive integer, got "
                f"{self.max_num_batched_tokens!r}"
            )


# How preempted requests get their KV back, and the orders of service (SchedulerConfig).
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class ParallelConfig:
    """How the model is split over devices, and what runs the ranks."""

    # Devices each layer is split across (tensor parallelism).
    tensor_parallel_size: int = 1
    # Stages the layers are split into (pipeline parallelism).
    pipeline_parallel_size: int = 1
    # What runs the ranks: "uni" (one rank, in the engine core's process), "mp" (one worker
    # process per rank, this host), "ray" (one Ray actor per rank, on a Ray cluster). None:
    # "uni" for one rank, else "mp".
    distributed_executor_backend: str | None = None
    # torch threads of each CPU worker (None: OMP_NUM_THREADS, else the cores / the ranks).
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and (
                isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        elif backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}")
        elif backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"the uni executor runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size is {self.world_size}: use --distributed-executor-backend "
                "mp (this host) or ray")

    @property
    def world_size(self) -> int:
        """Ranks (devices) the model runs on."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving (``--enable-lora``): how many adapters the device holds at once.

    Every adapted linear layer keeps ``max_loras`` slots of LoRA weights padded to
    ``max_lora_rank``; a step may mix requests of up to ``max_loras`` different adapters (and
    requests of none). Adapters are read on first use, kept in host memory up to
    ``max_cpu_loras`` and evicted least recently used.
    """

    # Adapters on the device at once (slots per adapted layer).
    max_loras: int = 1
    # Largest adapter rank accepted (the slots' padded rank).
    max_lora_rank: int = 16
    # Adapters kept read in host memory (None: max_loras); at least max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif (isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int)
              or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")


# The executors that can run a model's ranks (see ParallelConfig.distributed_executor_backend).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


# Proposal methods of --speculative-config (vLLM's names); only these run today.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Methods vLLM has that Octavo does not run yet (named in the error).
_SPECULATIVE_METHODS_NOT_YET = ("medusa", "mlp_speculator")
# The keys --speculative-config accepts.
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min",
                     "prompt_lookup_max", "model", "draft_tensor_parallel_size")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's JSON shape): a proposer guesses
    up to ``num_speculative_tokens`` next tokens of a request, and one target forward over
    all of them keeps the longest prefix the target's own sampling agrees with (see
    ``octavo.spec_decode``)."""

    # How drafts are proposed: "ngram" (prompt lookup in the request's own tokens) or
    # "draft_model" (a small model of the same vocabulary, run by the workers), "eagle" (an
    # EAGLE-1 head fed the target's hidden states, run by the workers; Llama targets) or
    # "eagle3" (an EAGLE-3 head fed three of the target's intermediate hidden states).
    method: str
    # Most draft tokens proposed per request and step (K).
    num_speculative_tokens: int
    # ngram: shortest and longest suffix of the request's tokens looked up (None: vLLM's
    # defaults: 5 and 5 when neither is given, else the one given for both).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: the draft model's local folder (same tokenizer and vocabulary); eagle,
    # eagle3: the EAGLE head's folder.
    model: str | None = None
    # draft_model: the draft's tensor-parallel size; only 1 (the draft runs whole, replicated
    # on every rank of a tensor-parallel target).
    draft_tensor_parallel_size: int | None = None
    # draft_model: the draft's resolved ModelConfig (set by EngineArgs.create_engine_config,
    # which reads its config.json and checks it against the target's).
    draft_model_config: Any = None

    def __post_init__(self) -> None:
        if self.method in _SPECULATIVE_METHODS_NOT_YET:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported yet; use "
                f"{', '.join(SPECULATIVE_METHODS)} (e.g. {{\"method\": \"ngram\", "
                f"\"num_speculative_tokens\": 4}})")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be a positive "
                             f"integer, got {k!r}")
        if self.uses_eagle and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config: method {self.method!r} needs \"model\": the "
                             "local folder of an EAGLE head trained for the target")
        if self.uses_draft_model:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs \"model\": the "
                                 "local folder of a small model with the target's vocabulary")
            tp = self.draft_tensor_parallel_size
            if tp is not None and tp != 1:
                raise ValueError("speculative_config: draft_tensor_parallel_size must be 1 (the "
                                 f"draft runs whole on each device), got {tp!r}")
            return
        if self.model is not None or self.draft_tensor_parallel_size is not None:
            raise ValueError("speculative_config: \"model\" and \"draft_tensor_parallel_size\" "
                             "are for methods 'draft_model', 'eagle' and 'eagle3' only")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"speculative_config: {name} must be a positive integer, "
                                 f"got {value!r}")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})")

    @property
    def uses_draft_model(self) -> bool:
        """The workers run a model that proposes ("draft_model", "eagle" or "eagle3"): its KV
        shares the target's blocks and it needs lookahead slots."""
        return self.method in ("draft_model", "eagle", "eagle3")

    @property
    def uses_eagle(self) -> bool:
        """An EAGLE head (EAGLE-1 or EAGLE-3) reading the target's hidden states."""
        return self.method in ("eagle", "eagle3")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a request needs past the tokens a step verifies: the draft model writes
        its KV for up to K proposal positions beyond them (0 for ngram)."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    @classmethod
    def from_user(cls, value: Any) -> SpeculativeConfig | None:
        """From ``--speculative-config`` JSON text, a dict (``LLM(speculative_config=...)``),
        a ``SpeculativeConfig`` or ``None`` (off). ``ValueError`` names what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON ({error}); pass e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object (a dict), got "
                             f"{type(value).__name__}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(_SPECULATIVE_KEYS)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config needs {required!r}, e.g. "
                                 '{"method": "ngram", "num_speculative_tokens": 4}')
        return cls(**value)


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
    # The backend's torch.distributed process-group backend (Backend.dist_backend).
    dist_backend: str = "gloo"
    # Multi-LoRA serving (None: --enable-lora is off).
    lora_config: LoRAConfig | None = None
    # Extra fields kept for logs/benchmarks.
    extra: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding (None: off).
    speculative_config: SpeculativeConfig | None = None
