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

With pipeline parallelism up to one step per stage is in flight (vLLM's "virtual engines"): a
new batch enters the first stage while earlier ones are still in later stages, so no stage
idles; a request is in at most one of them (its next step needs the token its last one
samples), and the oldest step is recorded once the pipeline is full or nothing new can run.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from octavo.config import EngineConfig
from octavo.executor import Executor, PendingOutput, create_executor
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
        self.executor: Executor = create_executor(config)
        try:
            num_blocks = self.executor.initialize_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_blocks = num_blocks
        pp_size = config.parallel_config.pipeline_parallel_size
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks=num_blocks,
            max_model_len=config.model_config.max_model_len,
            pipeline_parallel_size=pp_size,
        )
        self._block_hasher = block_hasher(config.cache_config.block_size)
        # Steps launched and not recorded yet, oldest first, and how many may be.
        self._in_flight: deque[_InFlightStep] = deque()
        self.max_in_flight = max(pp_size, 2 if config.scheduler_config.async_scheduling else 1)
        if pp_size > 1:
            logger.info("pipeline parallelism: up to %d steps in flight", self.max_in_flight)
        elif self.max_in_flight > 1:
            logger.info("async scheduling: the next step is scheduled while one runs")

    @property
    def async_scheduling(self) -> bool:
        """Whether the next step is scheduled while the previous one runs."""
        return self.max_in_flight > 1

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
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Run one batch and return what each request produced (with several steps in flight,
        launch the next batch and return what the oldest one produced, once there is one)."""
        if self.max_in_flight > 1:
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
        scheduler_output = self.scheduler.schedule()
        launched = False
        try:
            if not scheduler_output.is_empty:
                pending = self.executor.execute_model_async(scheduler_output)
                self._in_flight.append(_InFlightStep(scheduler_output, pending))
                launched = True
            elif scheduler_output.finished_req_ids:
                self.executor.execute_model(scheduler_output)  # lets the workers drop state
            if not self._in_flight or (launched and len(self._in_flight) < self.max_in_flight):
                return []  # the pipeline is still filling
            oldest = self._in_flight[0]
            runner_output = oldest.pending.result()
        except BaseException:
            # The steps not recorded cannot be trusted (KV writes, tokens in flight).
            unrecorded = [step.scheduler_output for step in self._in_flight]
            if not launched:
                unrecorded.append(scheduler_output)
            self._in_flight.clear()
            self.scheduler.discard_steps(unrecorded)
            self.executor.discard_in_flight()
            raise
        self._in_flight.popleft()
        return self.scheduler.update_from_output(oldest.scheduler_output, runner_output)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        try:
            while self._in_flight:  # let the devices finish before tearing down
                self._in_flight.popleft().pending.result()
        finally:
            self.executor.shutdown()
