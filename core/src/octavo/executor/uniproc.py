"""One worker in the engine's own process."""

from __future__ import annotations

import logging

from octavo.config import EngineConfig
from octavo.plugins import get_plugin_manager
from octavo.scheduler.output import SchedulerOutput
from octavo.worker.async_output import PendingStepOutput
from octavo.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


class UniprocExecutor:
    """Builds the backend's worker through ``octavo_worker_class`` and drives it directly."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        pm = get_plugin_manager()
        worker_cls = pm.hook.octavo_worker_class(
            backend=config.backend, parallel_config=config.parallel_config
        )
        if worker_cls is None:
            raise RuntimeError(
                f"backend {config.backend!r} provides no worker class (octavo_worker_class "
                "returned None); the backend package is incomplete"
            )
        self.worker = worker_cls(config, pm)
        self.worker.init_device()
        self.worker.load_model()

    def initialize_kv_cache(self) -> int:
        """Size and allocate the KV cache; return the number of blocks."""
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingStepOutput:
        """Launch a step without waiting for its tokens (a worker without
        ``execute_model_async`` runs it to completion here)."""
        launch = getattr(self.worker, "execute_model_async", None)
        if launch is None:
            return PendingStepOutput.ready(self.worker.execute_model(scheduler_output))
        return launch(scheduler_output)

    def discard_in_flight(self) -> None:
        """Tell the worker that launched steps' results will never be taken."""
        discard = getattr(self.worker, "discard_in_flight", None)
        if discard is not None:
            discard()

    def shutdown(self) -> None:
        self.worker.shutdown()
