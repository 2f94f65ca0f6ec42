"""Engines and workers of the backend under test, configured from its ``ConformancePlan``.

Every engine of the suite runs on the backend under test (``device=plan.backend``) in the
plan's dtype, block size and limits, with a fixed KV pool unless a test sizes it otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pluggy

from octavo.testing.plan import ConformancePlan

# KV blocks of the suite's engines unless a test wants a tight pool or memory sizing.
DEFAULT_NUM_BLOCKS = 256


def engine_kwargs(plan: ConformancePlan, **overrides: Any) -> dict[str, Any]:
    """``EngineArgs`` keywords for the backend under test; ``overrides`` win."""
    kwargs: dict[str, Any] = {
        "device": plan.backend,
        "dtype": plan.model_dtype,
        "block_size": plan.block_size,
        "max_num_seqs": plan.max_num_seqs,
        "max_model_len": plan.max_model_len,
    }
    if "kv_cache_memory_bytes" not in overrides:
        kwargs["num_gpu_blocks_override"] = DEFAULT_NUM_BLOCKS
    kwargs.update(overrides)
    return kwargs


@contextmanager
def open_llm(plan: ConformancePlan, model: Path, **overrides: Any) -> Iterator[Any]:
    """An ``octavo.LLM`` on the backend under test, shut down when the block ends."""
    import octavo

    llm = octavo.LLM(str(model), **engine_kwargs(plan, **overrides))
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def engine_config(plan: ConformancePlan, model: Path, **overrides: Any):
    """The ``EngineConfig`` an engine with these settings would get (checked like one)."""
    from octavo.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **engine_kwargs(plan, **overrides)).create_engine_config()


def make_worker(pm: pluggy.PluginManager, config: Any):
    """An instance of the worker class the backend's ``octavo_worker_class`` hook returns.

    Fails with an ``AssertionError`` saying what is wrong when the hook answers ``None`` or
    something that is not a ``Worker`` subclass.
    """
    from octavo.worker.worker import Worker

    worker_cls = pm.hook.octavo_worker_class(
        backend=config.backend, parallel_config=config.parallel_config
    )
    assert worker_cls is not None, f"octavo_worker_class returned None for {config.backend!r}"
    assert isinstance(worker_cls, type) and issubclass(worker_cls, Worker), (
        f"octavo_worker_class must return a subclass of octavo.worker.worker.Worker, "
        f"got {worker_cls!r}"
    )
    return worker_cls(config, pm)
