"""The typed messages that cross the engine's layers, in one leaf package.

Every layer may import from here; nothing here imports a layer above it (only
``octavo.sampling_params``, ``octavo.errors`` and third-party libraries):

- ``request``: ``Request`` (the engine core's record of one sequence), ``RequestStatus``, the
  identifier types ``RequestId`` and ``BlockHash``.
- ``engine_core``: front end <-> engine core: ``EngineCoreRequest``, ``EngineCoreOutput``,
  ``SchedulerStats`` and the process protocol (msgspec Structs, msgpack on the wire).
- ``scheduler_output``: scheduler -> workers: ``SchedulerOutput`` and its per-request parts,
  ``GrammarBitmask`` (the token masks of a step's constrained requests).
- ``runner_output``: workers -> scheduler: ``ModelRunnerOutput``.
- ``logprobs``: ``LogprobsLists``, the logprobs of consecutive positions.
- ``shared_masks``: ``SharedMasks``, the two buffers of grammar masks in shared memory that a
  ``GrammarBitmask`` may name instead of carrying its rows.
- ``executor``: executor <-> worker processes (``WorkerStep``, ``WorkerSample``, ...).
"""

from octavo.messages.engine_core import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from octavo.messages.logprobs import LogprobsLists
from octavo.messages.request import BlockHash, Request, RequestId, RequestStatus
from octavo.messages.runner_output import ModelRunnerOutput
from octavo.messages.scheduler_output import (
    CachedRequestData,
    ForkedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)

__all__ = [
    "BlockHash",
    "CachedRequestData",
    "EngineCoreOutput",
    "EngineCoreRequest",
    "ForkedRequestData",
    "GrammarBitmask",
    "LogprobsLists",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestId",
    "RequestStatus",
    "SchedulerOutput",
    "SchedulerStats",
]
