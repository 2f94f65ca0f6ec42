"""``EngineCore``: the scheduler + executor loop, free of tokenization and text.

Runs in the caller's process for the offline ``LLM``; the online server runs it in a
background process and talks to it with ``EngineCoreRequest``/``EngineCoreOutput`` messages.
"""

from __future__ import annotations

import logging

from octavo.config import EngineConfig
from octavo.engine.messages import EngineCoreOutput, EngineCoreRequest
from octavo.engine.request import Request, RequestStatus
from octavo.executor.uniproc import UniprocExecutor
from octavo.scheduler.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor; one ``step()`` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = UniprocExecutor(config)
        num_blocks = self.executor.initialize_kv_cache()
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks=num_blocks,
            max_model_len=config.model_config.max_model_len,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (raises ``ValueError`` subclasses for ones that cannot run)."""
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                max_tokens=request.max_tokens,
                block_size=self.config.cache_config.block_size,
                seed=request.seed,
                arrival_time=request.arrival_time,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """End requests the front end stopped (stop strings): their blocks are freed."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one batch, run it, and return what each request produced."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_req_ids:
                self.executor.execute_model(scheduler_output)  # lets the worker drop state
            return []
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except BaseException:
            # KeyboardInterrupt or a failed forward: the step's KV writes cannot be trusted.
            self.scheduler.discard_step(scheduler_output)
            raise
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
