"""Executors run a model's workers for the engine core (see ``octavo.executor.base``).

- ``uni``: one worker in the engine core's own process (``UniprocExecutor``);
- ``mp``: one worker process per rank on this host (``MultiprocExecutor``);
- ``ray``: one Ray actor per rank, placed on a Ray cluster (``RayExecutor``).

The last two share their steps' bookkeeping (``octavo.executor.worker_steps``) and run a
``WorkerHost`` (``octavo.executor.worker_host``) for each rank.
"""

from __future__ import annotations

from octavo.config import EngineConfig
from octavo.executor.base import Executor, PendingOutput
from octavo.executor.uniproc import UniprocExecutor
from octavo.messages.shared_masks import SharedMasks

__all__ = ["Executor", "PendingOutput", "UniprocExecutor", "create_executor"]


def create_executor(config: EngineConfig, shared_masks: SharedMasks | None = None) -> Executor:
    """The executor ``config.parallel_config.distributed_executor_backend`` names, started
    (its workers have loaded the model). ``shared_masks``: where the engine core's grammar
    masks are filled, if in shared memory; worker processes on this host (``mp``) map them
    and get only their buffer's number in a step's messages, and a worker (in this process or
    those) uploads them from there."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        return UniprocExecutor(config, shared_masks=shared_masks)
    if backend == "mp":
        from octavo.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, shared_masks=shared_masks)
    if backend == "ray":
        from octavo.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"unknown distributed_executor_backend {backend!r}")
