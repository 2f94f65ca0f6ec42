"""Capability negotiation: a configuration and each request, checked against the backend.

A backend declares what it supports in its ``BackendCapabilities``; every check of a value
against them lives here, so every such error reads the same way: the backend, the value, what
the backend supports, and what to do (a value it supports, or another installed backend that
runs here and supports the asked value). Where the checks run:

- ``fit_max_model_len`` and ``check_config``: at start-up, in
  ``EngineArgs.create_engine_config`` (so in the front end and in the engine-core process
  alike), before any weight is loaded.
- ``check_head_dim``: by ``check_config`` against the backend's declared head sizes, and by
  the worker against the attention implementation actually chosen (a plugin may replace a
  backend's kernels).
- ``check_request``: at admission, by ``octavo.engine.processor.Processor`` (``LLM.generate``
  and the OpenAI server, which answers 400).

Importing this module is cheap (no torch): configurations and sampling params are only
type-checked names here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from octavo.backends.backend import Backend, BackendCapabilities
from octavo.backends.selection import probe
from octavo.errors import CODE_UNSUPPORTED_BY_BACKEND, InvalidRequestError

if TYPE_CHECKING:
    from octavo.config import EngineConfig
    from octavo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class UnsupportedByBackendError(InvalidRequestError):
    """A configuration or a request asks for something the selected backend does not support
    (``param``: the request's field, for request checks)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code=CODE_UNSUPPORTED_BY_BACKEND)


def fit_max_model_len(backend: Backend, max_model_len: int, requested: int | None,
                      sliding_window: int | None = None) -> int:
    """The context length to use: the model's, lowered to the backend's limit when needed.

    Only a length the user did not ask for is lowered (and logged); a requested length beyond
    the backend's limit is left for ``check_config`` to reject. A backend without
    sliding-window attention runs a windowed model up to its (smallest) window, where full
    attention gives the same result.

    :param max_model_len: the length derived from the model (or the requested one).
    :param requested: what the user asked for (``--max-model-len``), or ``None``.
    :param sliding_window: the model's smallest attention window, or ``None``.
    """
    caps = backend.capabilities
    limit, why = caps.max_model_len, "the longest it supports"
    if sliding_window is not None and not caps.sliding_window and (
            limit is None or sliding_window < limit):
        limit, why = sliding_window, ("the model's attention window (the backend has no "
                                      "sliding-window attention)")
    if requested is None and limit is not None and max_model_len > limit:
        logger.info("backend %s: max_model_len lowered from the model's %d to %d, %s",
                    backend.name, max_model_len, limit, why)
        return limit
    return max_model_len


def check_config(backend: Backend, config: EngineConfig, others: Sequence[Backend] = ()) -> None:
    """Raise ``UnsupportedByBackendError`` unless ``backend`` supports ``config``.

    Checks, in order: dtype, quantization method, KV-cache dtype, the model's head size, KV
    block size, ``max_num_seqs``, ``max_model_len``, sliding-window attention (needed when a
    layer's window is shorter than ``max_model_len``), attention logit soft-capping. The error
    names the backend, the value and what it supports, and suggests a supported value and the
    backends among ``others`` (other installed ones) that are available here and support the
    value; they are probed only when a check fails.
    """
    caps = backend.capabilities
    model = config.model_config
    dtype = model.dtype_name
    if dtype not in caps.dtypes:
        _fail(backend, "dtype", dtype, ", ".join(caps.dtypes), f"--dtype {caps.dtypes[0]}",
              others, lambda c: dtype in c.dtypes)
    method = model.quantization
    if method is not None and method not in caps.quantization_methods:
        fix = ("--quantization none (dequantized while loading)" if model.gguf_file is not None
               else None)
        _fail(backend, "quantization", method,
              ", ".join(caps.quantization_methods) or "none", fix, others,
              lambda c: method in c.quantization_methods)
    kv_dtype = "fp8" if config.cache_config.cache_dtype.startswith("fp8") else "auto"
    if kv_dtype not in caps.kv_cache_dtypes:
        _fail(backend, "kv_cache_dtype", config.cache_config.cache_dtype,
              ", ".join(caps.kv_cache_dtypes), "--kv-cache-dtype auto", others,
              lambda c: kv_dtype in c.kv_cache_dtypes)
    check_head_dim(backend.name, model.head_dim, caps.head_dims, others=others)
    block_size = config.cache_config.block_size
    if caps.block_sizes is not None and block_size not in caps.block_sizes:
        suggested = 16 if 16 in caps.block_sizes else caps.block_sizes[0]
        _fail(backend, "block_size", block_size, ", ".join(map(str, caps.block_sizes)),
              f"--block-size {suggested}", others,
              lambda c: c.block_sizes is None or block_size in c.block_sizes)
    max_num_seqs = config.scheduler_config.max_num_seqs
    if caps.max_num_seqs is not None and max_num_seqs > caps.max_num_seqs:
        _fail(backend, "max_num_seqs", max_num_seqs, f"at most {caps.max_num_seqs}",
              f"--max-num-seqs {caps.max_num_seqs}", others,
              lambda c: c.max_num_seqs is None or max_num_seqs <= c.max_num_seqs)
    max_model_len = model.max_model_len
    if caps.max_model_len is not None and max_model_len > caps.max_model_len:
        _fail(backend, "max_model_len", max_model_len, f"at most {caps.max_model_len}",
              f"--max-model-len {caps.max_model_len}", others,
              lambda c: c.max_model_len is None or max_model_len <= c.max_model_len)
    windows = [w for w in model.sliding_windows if w is not None]
    if windows and not caps.sliding_window:
        alternatives = _alternatives(others, backend.name, lambda c: c.sliding_window)
        raise UnsupportedByBackendError(
            f"backend {backend.name!r} does not support sliding-window attention, which the "
            f"model uses (window {min(windows)}) below max_model_len {max_model_len}. "
            f"{_advice(f'--max-model-len {min(windows)}', alternatives)}"
        )
    cap = model.logits_soft_cap
    if cap is not None and not caps.logits_soft_cap:
        alternatives = _alternatives(others, backend.name, lambda c: c.logits_soft_cap)
        raise UnsupportedByBackendError(
            f"backend {backend.name!r} does not support attention logit soft-capping, which "
            f"the model uses (attn_logit_softcapping {cap}). {_advice(None, alternatives)}"
        )


def check_head_dim(
    backend: str,
    head_dim: int,
    supported: Sequence[int] | None,
    kernel: str | None = None,
    others: Sequence[Backend] = (),
) -> None:
    """Raise ``UnsupportedByBackendError`` when ``head_dim`` is not in ``supported``.

    :param backend: name of the selected backend.
    :param supported: head sizes the backend (or its attention implementation) handles;
        ``None`` accepts any.
    :param kernel: name of the attention implementation when the list comes from it.
    :param others: other installed backends, to suggest one that supports ``head_dim``.
    """
    if supported is None or head_dim in supported:
        return
    owner = f"attention implementation {kernel!r} of backend {backend!r}" if kernel else (
        f"backend {backend!r}")
    alternatives = _alternatives(
        others, backend, lambda c: c.head_dims is None or head_dim in c.head_dims)
    raise UnsupportedByBackendError(
        f"{owner} does not support head_dim {head_dim}, the model's attention head size "
        f"(supported: {', '.join(map(str, supported))}). {_advice(None, alternatives)}"
    )


def check_request(backend: str, capabilities: BackendCapabilities, params: SamplingParams) -> None:
    """Raise ``UnsupportedByBackendError`` when a request asks more than the backend supports.

    Called at admission, before anything is queued. Checks ``prompt_logprobs`` against
    ``capabilities.prompt_logprobs`` and the ``logprobs``/``prompt_logprobs`` counts against
    ``capabilities.max_logprobs``. The error's ``param`` is the field (the OpenAI server reports
    it). The prompt and completion lengths need no check of
    their own: ``max_model_len`` is already within the backend's limit.
    """
    if params.prompt_logprobs is not None and not capabilities.prompt_logprobs:
        raise UnsupportedByBackendError(
            f"prompt_logprobs are not supported by backend {backend!r}, which does not compute "
            f"logprobs of prompt tokens (got prompt_logprobs={params.prompt_logprobs}); leave "
            "prompt_logprobs unset", param="prompt_logprobs",
        )
    limit = capabilities.max_logprobs
    if limit is None:
        return
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise UnsupportedByBackendError(
                f"{name} must be at most {limit} on backend {backend!r} (the most it returns "
                f"per token), got {value}", param=name,
            )


# ---- error messages ---------------------------------------------------------------------------


def _fail(
    backend: Backend,
    what: str,
    value: object,
    supported: str,
    fix: str | None,
    others: Sequence[Backend],
    accepts: Callable[[BackendCapabilities], bool],
) -> None:
    alternatives = _alternatives(others, backend.name, accepts)
    raise UnsupportedByBackendError(
        f"backend {backend.name!r} does not support {what} {value} (supported: {supported}). "
        f"{_advice(fix, alternatives)}"
    )


def _alternatives(
    others: Sequence[Backend], selected: str, accepts: Callable[[BackendCapabilities], bool]
) -> list[str]:
    """Names of the other backends that are available here and accept the value."""
    return [b.name for b in others
            if b.name != selected and accepts(b.capabilities) and probe(b).available]


def _advice(fix: str | None, alternatives: list[str]) -> str:
    options = ([fix] if fix else []) + [f"--device {name}" for name in alternatives]
    if not options:
        return "No other installed backend that runs here supports it."
    return f"Use {' or '.join(options)}."
