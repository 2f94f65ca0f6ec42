"""Octavo's plug-in surface: every pluggy hook specification, in one place.

A backend or plugin is a module (or object) of ``@hookimpl`` functions registered through a
Python entry point in the ``octavo`` group::

    # pyproject.toml of the plugin
    [project.entry-points.octavo]
    mydevice = "octavo_mydevice.plugin"

Two kinds of hooks:

* **Contribution hooks** take a ``register`` callback and may be implemented by any number of
  plugins (``octavo_register_backends``, ``octavo_register_models``,
  ``octavo_register_quantization_methods``, ``octavo_register_tool_parsers``,
  ``octavo_register_reasoning_parsers``, ``octavo_register_routes``). New keyword arguments can
  be added to ``register`` later without breaking plugins.
* **Selection hooks** are ``firstresult``: pluggy calls implementations (latest registered and
  ``tryfirst`` ones first) and stops at the first non-``None`` result. Every selection hook gets
  the chosen ``backend`` name first; an implementation returns ``None`` for a backend that is not
  its own. A separately installed plugin can therefore replace one piece of an existing backend
  (say, a faster attention kernel for ``cpu``) with ``@hookimpl(tryfirst=True)``.

When each hook is called (every spec's docstring says it exactly): ``octavo_register_backends``
whenever backends are listed or one is selected (engine creation, ``octavo backends``);
``octavo_worker_class`` by the executor in the engine process; ``octavo_attention_backend``,
``octavo_register_models``, ``octavo_register_quantization_methods``, ``octavo_quant_kernels``,
``octavo_available_kv_cache_memory`` and ``octavo_kv_block_mover`` in the worker while it loads
the model and sizes the KV cache (the quantization methods are also listed in the engine
process, to resolve ``--quantization``); ``octavo_register_logits_processors`` in the front end
(to check requests) and in the worker (to run them). With today's uniproc executor all of them
run in the engine's process. ``octavo_register_tool_parsers`` and
``octavo_register_reasoning_parsers`` are called by the front end (the OpenAI server,
``octavo serve``'s flag checks and ``EngineArgs``), never by a worker; ``octavo_register_routes``
by each API server process as it builds its app.
``docs/writing-a-backend.md`` documents every hook; ``tests/test_docs.py`` keeps the two in
step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from fastapi import APIRouter

    from octavo.attention.base import AttentionBackend
    from octavo.backends.backend import Backend
    from octavo.config import CacheConfig, ModelConfig, ParallelConfig
    from octavo.model_executor.layers.quantization.base import QuantizationConfig
    from octavo.sample.logits_processor import LogitsProcessor
    from octavo.worker.kv_block_mover import KVBlockMover
    from octavo.worker.worker import Worker

PROJECT_NAME = "octavo"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def octavo_register_backends(register: Callable[[Backend], None]) -> None:
    """Describe the hardware backends this plugin provides.

    Called every time backends are listed or one is selected (``octavo.backends.list_backends``:
    when an engine is created, and by ``octavo backends``), in the engine process; may be called
    many times, so it must be cheap and side-effect free: import no device runtime (no
    ``torch.cuda`` initialisation, no kernels). Availability is probed separately through
    ``Backend.is_available``. Registering a name twice (two plugins) is an error.
    ``Backend.capabilities`` declares what the backend supports (dtypes, head sizes, block
    sizes, CUDA graphs, batch and length limits, logprobs); the core checks the engine's
    configuration against it at start-up and every request at admission
    (``octavo.backends.capabilities``), so an unsupported setting is a clear error, never a
    crash inside a kernel.

    :param register: call ``register(Backend(...))`` once per backend provided.
    """


@hookspec(firstresult=True)
def octavo_attention_backend(
    backend: str, model_config: ModelConfig, cache_config: CacheConfig
) -> AttentionBackend | None:
    """Return the attention implementation for ``backend`` and this model.

    Called once per engine in the worker process (``Worker.load_model``), before the model is
    built. The returned object makes one ``AttentionImpl`` per layer and fixes the KV-cache
    tensor layout; the worker checks the model's head size against its
    ``supported_head_dims()``.

    :param backend: name of the selected backend (e.g. ``"cpu"``).
    :param model_config: the model being served (head dims, dtype, ...).
    :param cache_config: block size and cache dtype.
    :return: an ``AttentionBackend``, or ``None`` if ``backend`` is not this plugin's.
        Stops at the first non-``None`` result.
    """


@hookspec(firstresult=True)
def octavo_available_kv_cache_memory(
    backend: str, worker: Worker, cache_config: CacheConfig
) -> int | None:
    """Return how many bytes the KV cache may take on this worker's device.

    Called once per engine in the worker process after the model weights are loaded and before
    the KV cache is allocated; not called at all when ``cache_config.num_gpu_blocks_override``
    is set. The worker divides the answer by ``worker.kv_cache_bytes_per_block()`` (rounding
    down) and fails with a clear error if not even one block fits.
    Implementations typically run ``worker.profile_run()`` (a forward pass of the
    largest step the scheduler may build) and subtract peak usage from the memory budget set by
    ``cache_config`` (``kv_cache_memory_bytes`` wins when set).

    :param backend: name of the selected backend.
    :param worker: the worker whose device is measured (``worker.device``, ``worker.model``).
    :param cache_config: the memory budget settings.
    :return: bytes (> 0), or ``None`` if ``backend`` is not this plugin's.
        Stops at the first non-``None`` result.
    """


@hookspec(firstresult=True)
def octavo_worker_class(backend: str, parallel_config: ParallelConfig) -> type[Worker] | None:
    """Return the ``Worker`` subclass that runs the model on ``backend``'s device.

    Called once per engine by the executor, in the engine process, before workers are started;
    the executor then calls ``init_device()`` and ``load_model()`` on an instance
    ``worker_cls(config, pm)``.

    :param backend: name of the selected backend.
    :param parallel_config: tensor-parallel size and distributed settings.
    :return: a subclass of ``octavo.worker.worker.Worker``, or ``None`` if ``backend`` is not
        this plugin's. Stops at the first non-``None`` result.
    """


@hookspec
def octavo_register_models(register: Callable[[str, type[Any]], None]) -> None:
    """Add model architectures.

    Called every time a model is loaded, in the worker process, to build a fresh registry
    (``octavo.model_executor.model_loader.resolve_model_class``). Octavo's own architectures are
    registered through this same hook (``octavo.model_executor.models.builtin_plugin``). Within
    one call a later registration of a name replaces an earlier one; the built-in implementation
    is ``tryfirst``, so pluggy calls it before any plain ``@hookimpl`` and a plugin can both add
    architectures and replace a built-in name (e.g. its own ``LlamaForCausalLM``).

    :param register: call ``register("MyArchForCausalLM", MyArchForCausalLM)``; the class
        follows the contract of ``octavo.model_executor.models.llama.LlamaForCausalLM``
        (constructor ``(hf_config, attn_backend)``, ``forward``, ``compute_logits``,
        ``load_weights``). The name is matched against ``config.json``'s ``architectures``.
    """


@hookspec
def octavo_register_quantization_methods(
    register: Callable[[str, type[QuantizationConfig]], None],
) -> None:
    """Add quantization methods (what ``--quantization NAME`` selects).

    Called whenever the methods are listed: in the engine process when ``--quantization`` and
    the checkpoint's ``quantization_config`` are resolved, and in the worker when the model is
    built (``octavo.model_executor.layers.quantization.registry``). Octavo's own methods
    (``fp8``, ``compressed-tensors``, ``awq``, ``gptq``, ``gguf``) register through this same
    hook; a later registration of a name replaces an earlier one. A backend runs a method only
    if it lists the name in ``BackendCapabilities.quantization_methods``.

    :param register: call ``register("mymethod", MyQuantizationConfig)``; the class follows
        the contract of ``octavo.model_executor.layers.quantization.base.QuantizationConfig``
        (``from_source``, ``linear_method``; ``checkpoint_methods`` names the
        ``quant_method`` values of checkpoints it reads).
    """


@hookspec(firstresult=True)
def octavo_quant_kernels(backend: str, method: str) -> Any | None:
    """Return the kernels ``backend`` provides for quantization ``method``.

    Called once per engine in the worker process, when a quantized model is built, before its
    weights load. The object reaches the method as ``QuantizationConfig.kernels``; each method
    documents the functions it looks for on it (the ``gguf`` method calls
    ``kernels.gguf_matmul(x, blocks, qtype, in_features)``) and uses its own kernels (Triton
    on GPUs, torch elsewhere) for anything the object lacks.

    :param backend: name of the selected backend.
    :param method: the quantization method's name (``"gguf"``, ``"fp8"``, ...).
    :return: an object with the method's kernel functions, or ``None`` if ``backend`` is not
        this plugin's or it has no kernels for ``method``.
        Stops at the first non-``None`` result.
    """


@hookspec(firstresult=True)
def octavo_kv_block_mover(
    backend: str, attn_backend: AttentionBackend, device: torch.device
) -> KVBlockMover | None:
    """Return what moves whole KV blocks on this worker: to and from its host block pool
    (preemption by swapping, ``--preemption-mode swap``) and within its device cache
    (copy-on-write of blocks shared by the completions of an n > 1 request or by beams).

    Called once per engine in each worker process, when the KV cache is allocated
    (``ModelRunner.initialize_kv_cache``). Every move of a step is one call over all its
    blocks (batched: a gather and a scatter per layer, never a copy per block), made before the
    step's forward. ``octavo.worker.kv_block_mover.TorchKVBlockMover`` is what the built-in
    backends return (``BackendPlugin``'s default); a backend with its own cache layout or copy
    engine returns its own.

    :param backend: name of the selected backend.
    :param attn_backend: the attention implementation, which fixes the cache layout (the
        blocks are on its ``kv_cache_block_dim``).
    :param device: this worker's device.
    :return: an ``octavo.worker.kv_block_mover.KVBlockMover``; ``None`` if ``backend`` is not
        this plugin's. Stops at the first non-``None`` result.
    """


@hookspec
def octavo_register_tool_parsers(register: Callable[[str, type[Any]], None]) -> None:
    """Add tool-call parsers, the formats ``--tool-call-parser NAME`` can read.

    Called each time the registry is built, in the front-end process: when ``octavo serve``
    checks its flags and when the OpenAI server starts
    (``octavo.entrypoints.openai.tool_parsers.tool_parsers``). Octavo's own parsers
    (``hermes``, ``llama3_json``, ``mistral``) register through this same hook
    (``octavo.entrypoints.openai.tool_parsers.builtin_plugin``, ``tryfirst``), so a later
    registration of a name by a plugin replaces a built-in one.

    :param register: call ``register("myformat", MyToolParser)``; the class subclasses
        ``octavo.entrypoints.openai.tool_parsers.ToolParser`` (one instance per completion,
        ``feed``/``finish`` for streamed text, ``extract`` for a whole text).
    """


@hookspec
def octavo_register_logits_processors(
    register: Callable[[str, type[LogitsProcessor]], None],
) -> None:
    """Add logits processors that requests select by name (``logits_processors``).

    Called every time the registry is built: once in the front end, to check the names and
    arguments of requests (``octavo.engine.processor``), and once in each worker process, to
    run them (``octavo.sample.logits_processor.LogitsProcessors``). Built-in processors register
    through this same hook (``octavo.sample.builtin_logits_processors``). Registering a name
    twice is an error.

    :param register: call ``register("my_name", MyProcessor)``; the class follows the contract
        of ``octavo.sample.logits_processor.LogitsProcessor`` (constructed once per worker with
        ``(vocab_size, device)``, then ``apply`` on the rows of every step that selected it,
        batched on the device).
    """


@hookspec
def octavo_register_reasoning_parsers(register: Callable[[str, type[Any]], None]) -> None:
    """Add reasoning parsers, the formats ``--reasoning-parser NAME`` can split.

    Called each time the registry is built, in the front-end process: when the engine options
    are checked (``EngineArgs.create_engine_config``) and when the OpenAI server starts
    (``octavo.reasoning.reasoning_parsers``). Octavo's own parsers (``deepseek_r1``,
    ``qwen3``) register through this same hook (``octavo.reasoning.builtin_plugin``,
    ``tryfirst``), so a later registration of a name by a plugin replaces a built-in one.

    :param register: call ``register("myformat", MyReasoningParser)``; the class subclasses
        ``octavo.reasoning.ReasoningParser`` (its tags, and where the text starts).
    """


@hookspec
def octavo_register_routes(register: Callable[[APIRouter], None]) -> None:
    """Add HTTP routes to the OpenAI-compatible server (``octavo serve``), beside ``/v1/...``.

    Called once in each API server process (one, or ``--api-server-count`` of them) while it
    builds its app, before it serves (``octavo.entrypoints.openai.plugin_routes``); never by
    the offline ``LLM`` or a worker. The routes are included after the server's own, behind the
    same middleware: with ``--api-key`` they need the key like every path but ``/health`` and
    ``/metrics``. A route whose method and path the server already answers (or another plugin's
    does), or one under a mount of the server's (``/docs/assets``), stops the start-up with a
    ``ValueError`` naming it: plugins add routes, they do not replace Octavo's.

    :param register: call ``register(router)`` with a ``fastapi.APIRouter`` (anything else is a
        ``TypeError``). A handler reaches the engine as ``request.app.state.engine``, the
        process's ``AsyncLLM`` (its ``model_config``, ``generate``, ``check_health``, ...).
    """
