"""``EngineCore``: the scheduler + executor loop, free of tokenization and text.

Runs in the caller's process for the offline ``LLM``; the online server runs it in a
background process and talks to it with ``EngineCoreRequest``/``EngineCoreOutput`` messages.

With async scheduling (``SchedulerConfig.async_scheduling``) ``step()`` is pipelined: it
schedules and launches step N+1, then waits for step N's tokens and records them, so the
scheduler, input preparation and output handling of one step run while the device computes
the other. The outputs are the same as one step at a time: a decode whose input token is still
being sampled reads it on the device, a request whose last allowed token is in flight is not
scheduled again, and one that stops on a sampled token (EOS, stop id) had one more token
computed that is thrown away. Each ``step()`` returns the outputs of the step before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from octavo.config import EngineConfig
from octavo.executor import Executor, PendingOutput, UniprocExecutor
from octavo.kv_cache.hashing import block_hasher
from octavo.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    Request,
    RequestStatus,
    SchedulerOutput,
    SchedulerStats,
)
from octavo.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlightStep:
    """A launched step whose results have not been recorded."""

    scheduler_output: SchedulerOutput
    pending: PendingOutput


class EngineCore:
    """Owns the scheduler and the executor; one ``step()`` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor: Executor = UniprocExecutor(config)
        num_blocks = self.executor.initialize_kv_cache()
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks=num_blocks,
            max_model_len=config.model_config.max_model_len,
        )
        self._block_hasher = block_hasher(config.cache_config.block_size)
        self.async_scheduling = config.scheduler_config.async_scheduling
        self._in_flight: _InFlightStep | None = None
        if self.async_scheduling:
            logger.info("async scheduling: the next step is scheduled while one runs")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request validated by the front end (``octavo.engine.processor``)."""
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_hasher=self._block_hasher,
                arrival_time=request.arrival_time,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """End requests the front end stopped (stop strings): their blocks are freed."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has work: requests to run, or a launched step to record."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Run one batch and return what each request produced (with async scheduling, launch
        the next batch and return what the previous one produced)."""
        if self.async_scheduling:
            return self._step_pipelined()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_req_ids:
                self.executor.execute_model(scheduler_output)  # lets the worker drop state
            return []
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except BaseException:
            # KeyboardInterrupt or a failed forward: the step's KV writes cannot be trusted.
            self.scheduler.discard_steps([scheduler_output])
            raise
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        previous = self._in_flight
        self._in_flight = None
        scheduler_output = self.scheduler.schedule()
        unrecorded = [scheduler_output] if previous is None else [
            previous.scheduler_output, scheduler_output
        ]
        try:
            if not scheduler_output.is_empty:
                launched = self.executor.execute_model_async(scheduler_output)
                self._in_flight = _InFlightStep(scheduler_output, launched)
            elif scheduler_output.finished_req_ids:
                self.executor.execute_model(scheduler_output)  # lets the worker drop state
            if previous is None:
                return []
            runner_output = previous.pending.result()
        except BaseException:
            # The steps not recorded cannot be trusted (KV writes, tokens in flight).
            self._in_flight = None
            self.scheduler.discard_steps(unrecorded)
            self.executor.discard_in_flight()
            raise
        return self.scheduler.update_from_output(previous.scheduler_output, runner_output)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        if self._in_flight is not None:
            self._in_flight.pending.result()  # let the device finish before tearing down
            self._in_flight = None
        self.executor.shutdown()
