"""``WorkerStepsExecutor``: what the executors of ranks in other processes share.

The multiprocess and the Ray executor differ in how a message reaches the ranks (zmq sockets,
Ray actor calls) and in how they notice a rank is gone. The rest is the same and lives here:
steps numbered from 1 and sent to every rank as ``WorkerStep``; a deferred step's sampling as
``WorkerSample``, for the step ``UnsampledSteps`` names (so the next step may go first:
``prepares_ahead``, without pipeline stages); a ``WorkerFlush`` when the engine core waits for
the last step sent; the output rank's results kept by step number until taken; the KV cache
sized by the smallest rank's.

A subclass gives ``_send`` (one message to every rank, in the order sent), ``_next_events``
(wait for the output rank's next answers), ``_call`` (a lifecycle method on every rank) and
``_fail`` (stop every rank and raise).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import logging
from typing import NoReturn

from octavo.config import EngineConfig
from octavo.executor.base import LaunchedStep, UnsampledSteps
from octavo.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from octavo.messages.executor import (
    WorkerEvent,
    WorkerFlush,
    WorkerInput,
    WorkerSample,
    WorkerStep,
    WorkerStepResult,
)
from octavo.messages.shared_masks import SharedMasks, by_reference

logger = logging.getLogger(__name__)


class WorkerStepsExecutor(abc.ABC):
    """The ``Executor`` protocol's steps over ``octavo.messages.executor`` (module docstring)."""

    def __init__(self, config: EngineConfig, shared_masks: SharedMasks | None = None) -> None:
        """``shared_masks``: the grammar masks' buffers when every rank maps them (a step's
        bitmask in them is sent by reference); None: bitmasks carry their rows."""
        self.config = config
        self.world_size = config.parallel_config.world_size
        self._shared_masks = shared_masks
        self._step_ids = itertools.count(1)
        self._last_step_sent = 0
        self._last_flush_sent = 0
        self._unsampled = UnsampledSteps()
        # See UnsampledSteps: the next step may be sent before the sample of the one before.
        self.prepares_ahead = config.parallel_config.pipeline_parallel_size == 1
        self._results: dict[int, ModelRunnerOutput] = {}

    # ---- what a subclass gives -------------------------------------------------------------

    @abc.abstractmethod
    def _send(self, message: WorkerInput) -> None:
        """Send ``message`` to every rank (each rank sees messages in the order sent)."""

    @abc.abstractmethod
    def _next_events(self) -> list[WorkerEvent]:
        """Wait for the output rank's next answers; ``_fail`` when a rank is gone or none
        answers in time."""

    @abc.abstractmethod
    def _call(self, method: str, arg: int | None = None) -> list[int | None]:
        """Call a lifecycle method on every rank; each rank's value, in rank order."""

    @abc.abstractmethod
    def _fail(self, reason: str) -> NoReturn:
        """Stop every rank and raise ``WorkerDiedError``."""

    # ---- the Executor protocol -------------------------------------------------------------

    def initialize_kv_cache(self) -> int:
        counts = self._call("determine_num_blocks")
        num_blocks = min(counts)
        if len(set(counts)) > 1:
            logger.info("KV blocks per rank %s: every rank uses %d", counts, num_blocks)
        self._call("initialize_cache", num_blocks)
        return num_blocks

    def initialize_swap_space(self) -> int:
        num_blocks = min(self._call("determine_num_host_blocks"))
        self._call("initialize_host_cache", num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        step_id = next(self._step_ids)
        bitmask = scheduler_output.grammar_bitmask
        if bitmask is not None and self._shared_masks is not None:
            scheduler_output = dataclasses.replace(scheduler_output,
                                                   grammar_bitmask=by_reference(bitmask))
        self._send(WorkerStep(step_id=step_id, scheduler_output=scheduler_output))
        self._last_step_sent = step_id
        self._unsampled.launched(step_id, scheduler_output)
        return LaunchedStep(self, step_id)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        step_id = self._unsampled.next_to_sample(self._last_step_sent)
        if grammar_bitmask is not None and self._shared_masks is not None:
            grammar_bitmask = by_reference(grammar_bitmask)
        self._send(WorkerSample(step_id=step_id, grammar_bitmask=grammar_bitmask))

    def discard_in_flight(self) -> None:
        self._results.clear()
        self._unsampled.clear()

    def wait_step(self, step_id: int) -> ModelRunnerOutput:
        """The output rank's results of step ``step_id`` (asking for them when no later step
        was launched to push them out)."""
        if step_id not in self._results and self._last_flush_sent < step_id \
                and self._last_step_sent == step_id:
            self._send(WorkerFlush(step_id=step_id))
            self._last_flush_sent = step_id
        while step_id not in self._results:
            for event in self._next_events():
                if isinstance(event, WorkerStepResult):
                    if event.error is not None:
                        self._fail(f"the step failed on {event.error}")
                    assert event.output is not None
                    self._results[event.step_id] = event.output
        return self._results.pop(step_id)
