"""Splitting a model over devices: ranks, process groups and the collectives layers use.

See ``octavo.distributed.parallel_state``. The executors that start one worker per rank are in
``octavo.executor``; the layers that split their weights are in
``octavo.model_executor.layers.linear`` and ``octavo.model_executor.layers.vocab``.
"""

from octavo.distributed.parallel_state import (
    ParallelRanks,
    ParallelState,
    destroy_parallel_state,
    divide,
    init_parallel_state,
)

__all__ = [
    "ParallelRanks",
    "ParallelState",
    "destroy_parallel_state",
    "divide",
    "init_parallel_state",
]
