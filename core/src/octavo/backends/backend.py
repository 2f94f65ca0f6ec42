"""``Backend``: what a hardware plugin says about itself through ``octavo_register_backends``.

Cheap to import (no torch): backend plugins import it at discovery time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Availability:
    """Answer of a backend's availability probe."""

    # Whether the backend can run here.
    available: bool
    # Why not (or a short description of the device found when it is available).
    reason: str


# Model/KV-cache dtype names a backend may list (the values of --dtype other than "auto"),
# most precise first.
KNOWN_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend's kernels and worker support; every field has a permissive default.

    The core checks an engine's configuration against these once, at start-up
    (``octavo.backends.capabilities.check_config``: dtype, head size, block size,
    ``max_num_seqs``, ``max_model_len``, sliding windows, logit soft-capping), and every
    request at admission
    (``check_request``: logprob counts, prompt logprobs); a mismatch is a ``ValueError`` that
    names the backend, the value and what is supported. ``None`` means "no limit of the
    backend's own" (memory and the model still apply). ``octavo backends`` shows them all.
    """

    # Model/KV dtypes the kernels handle, as torch dtype names from KNOWN_DTYPES.
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # Attention head sizes the kernels handle (None: any).
    head_dims: tuple[int, ...] | None = None
    # KV-cache block sizes (tokens per block) the kernels handle (None: any positive size).
    block_sizes: tuple[int, ...] | None = None
    # Whether decode steps can be captured as CUDA graphs (--enforce-eager turns them off).
    # Declaring it also promises that the attention kernels skip padding tokens (slot -1, in
    # no sequence) on every path: GPU workers pad eager steps' token counts with them
    # (octavo.worker.row_ladder).
    cuda_graphs: bool = False
    # Whether steps in which each sequence adds a few tokens (speculative decoding's
    # verification) can be captured too: the attention's multi-token path must read no
    # host-side metadata and launch a grid fixed by the step's shape.
    cuda_graphs_multi_token: bool = False
    # Whether the device runs work asynchronously to the host, so scheduling the next step
    # while the current one runs pays off: the default of --async-scheduling.
    async_scheduling: bool = False
    # The chunked-prefill token budget when --max-num-batched-tokens is not given: large enough
    # that a step carrying prompt chunks keeps the device busy rather than waiting on the
    # host's launch of the step (prompt and mixed steps run eagerly), small enough that the
    # decodes sharing the step are not held up long.
    default_max_num_batched_tokens: int = 2048
    # Most sequences one step may hold (caps --max-num-seqs; None: no limit).
    max_num_seqs: int | None = None
    # Longest sequence, prompt + completion, in tokens (caps --max-model-len; None: no limit).
    max_model_len: int | None = None
    # Whether prompt logprobs (SamplingParams.prompt_logprobs) can be computed.
    prompt_logprobs: bool = True
    # Most top logprobs per token a request may ask for (logprobs, prompt_logprobs; None: no
    # limit beyond the vocabulary).
    max_logprobs: int | None = None
    # Quantization methods whose kernels run here (names of --quantization: "fp8", "awq",
    # "gptq", "gguf", ...); a model quantized with another is refused at start-up, never
    # silently dequantized. Empty: dense weights only (a GGUF file is then dequantized while
    # loading unless --quantization gguf is asked for, which is refused).
    quantization_methods: tuple[str, ...] = ()
    # --kv-cache-dtype values the attention kernels read and write ("auto": the model's
    # dtype; "fp8": float8 e4m3 with per-tensor scales, which also admits "fp8_e4m3").
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # Whether the attention kernels implement sliding-window attention (Mistral, Gemma's local
    # layers, ...). Without it a windowed model runs only with max_model_len within its window.
    sliding_window: bool = False
    # Whether the attention kernels implement attention logit soft-capping (Gemma 2).
    logits_soft_cap: bool = False

    def __post_init__(self) -> None:
        for name in ("dtypes", "head_dims", "block_sizes", "quantization_methods",
                     "kv_cache_dtypes"):
            # lists are accepted, kept as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.dtypes or any(d not in KNOWN_DTYPES for d in self.dtypes):
            raise ValueError(
                f"BackendCapabilities.dtypes must be a non-empty tuple of {KNOWN_DTYPES}, "
                f"got {self.dtypes!r}"
            )
        if not all(isinstance(m, str) and m for m in self.quantization_methods):
            raise ValueError(
                "BackendCapabilities.quantization_methods must be a tuple of method names, "
                f"got {self.quantization_methods!r}"
            )
        if "auto" not in self.kv_cache_dtypes or not set(self.kv_cache_dtypes) <= {"auto", "fp8"}:
            raise ValueError(
                "BackendCapabilities.kv_cache_dtypes must hold 'auto' and optionally 'fp8', "
                f"got {self.kv_cache_dtypes!r}"
            )
        for name in ("head_dims", "block_sizes"):
            values = getattr(self, name)
            if values is not None and (not values or not all(_positive_int(v) for v in values)):
                raise ValueError(
                    f"BackendCapabilities.{name} must be None (any) or a non-empty tuple of "
                    f"positive integers, got {values!r}"
                )
        if not _positive_int(self.default_max_num_batched_tokens):
            raise ValueError("BackendCapabilities.default_max_num_batched_tokens must be a "
                             f"positive integer, got {self.default_max_num_batched_tokens!r}")
        for name in ("max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(
                    f"BackendCapabilities.{name} must be None (no limit) or a positive "
                    f"integer, got {value!r}"
                )
        if self.max_logprobs is not None and not (
            _positive_int(self.max_logprobs) or self.max_logprobs == 0
        ):
            raise ValueError(
                "BackendCapabilities.max_logprobs must be None (no limit) or an integer >= 0, "
                f"got {self.max_logprobs!r}"
            )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, slots=True)
class Backend:
    """One hardware backend, as registered by its plugin.

    ``is_available`` must be cheap and must not initialise a device runtime eagerly beyond
    what is needed to answer (it is called by ``octavo backends`` for every backend).
    """

    # Short unique name used by --device, e.g. "cpu", "cuda".
    name: str
    # torch device type tensors live on ("cpu", "cuda").
    device_type: str
    # Higher wins when no device is named and several backends are available.
    priority: int
    # Probe: can this backend run on this machine, and if not, why.
    is_available: Callable[[], Availability]
    # Distribution that provides it (shown in listings and error messages).
    package: str
    # torch.distributed process-group backend for tensor parallelism ("gloo", "nccl").
    dist_backend: str = "gloo"
    # What the kernels and worker support (see BackendCapabilities).
    capabilities: BackendCapabilities = field(default_factory=BackendCapabilities)
    # One line for `octavo backends`.
    description: str = ""
