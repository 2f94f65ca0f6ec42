"""Executors run a model's workers for the engine core (see ``octavo.executor.base``).

- ``uni``: one worker in the engine core's own process (``UniprocExecutor``);
- ``mp``: one worker process per rank on this host (``MultiprocExecutor``);
- ``ray``: one Ray actor per rank, placed on a Ray cluster (``RayExecutor``).
"""

from __future__ import annotations

from octavo.config import EngineConfig
from octavo.executor.base import Executor, PendingOutput
from octavo.executor.uniproc import UniprocExecutor

__all__ = ["Executor", "PendingOutput", "UniprocExecutor", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """The executor ``config.parallel_config.distributed_executor_backend`` names, started
    (its workers have loaded the model)."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        return UniprocExecutor(config)
    if backend == "mp":
        from octavo.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from octavo.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"unknown distributed_executor_backend {backend!r}")
