"""One worker in the engine core's own process."""

from __future__ import annotations

import logging

from octavo.config import EngineConfig
from octavo.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from octavo.messages.shared_masks import SharedMasks
from octavo.plugins import get_plugin_manager
from octavo.worker.async_output import StepOutput
from octavo.worker.worker import Worker, create_worker

logger = logging.getLogger(__name__)


class UniprocExecutor:
    """Builds the backend's worker through ``octavo_worker_class`` and drives it directly.

    Implements ``octavo.executor.base.Executor``.
    """

    # The worker's runner prepares a step while the one before waits for its sampling.
    prepares_ahead = True

    def __init__(self, config: EngineConfig, shared_masks: SharedMasks | None = None) -> None:
        """``shared_masks``: where the engine core's grammar masks are filled, if in shared
        memory (the worker may upload them from there: ``Worker.use_grammar_mask_buffers``)."""
        self.config = config
        self.worker: Worker = create_worker(config, get_plugin_manager())
        self.worker.init_device()
        self.worker.init_distributed()
        self.worker.load_model()
        if shared_masks is not None:
            self.worker.use_grammar_mask_buffers(shared_masks.array)

    def initialize_kv_cache(self) -> int:
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks)
        return num_blocks

    def initialize_swap_space(self) -> int:
        num_blocks = self.worker.determine_num_host_blocks()
        self.worker.initialize_host_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepOutput:
        return self.worker.execute_model_async(scheduler_output)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        self.worker.sample_tokens(grammar_bitmask)

    def discard_in_flight(self) -> None:
        self.worker.discard_in_flight()

    def check_health(self) -> None:
        """The worker runs in this process: it is alive as long as the caller is."""

    def shutdown(self) -> None:
        self.worker.shutdown()
