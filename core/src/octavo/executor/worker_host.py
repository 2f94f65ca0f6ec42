"""``WorkerHost``: one rank of a split model, answering the executor's typed messages.

The multiprocess executor runs one host per worker process (messages over zmq), the Ray
executor one per actor (messages as Ray call arguments); both speak
``octavo.messages.executor``, encoded with msgspec.

Steps are handled in the order they arrive. ``WorkerStep`` N launches step N and then finishes
the steps before it, so with several steps in flight (async scheduling, pipeline stages) a
rank's device runs step N while its host reads back step N-1. A step launched with
``sampling_deferred`` is finished only after its ``WorkerSample``: when the executor prepares
ahead, step N+1 arrives before step N's sample (the runner prepares N+1 and launches it right
after that sampling), and the sample message then finishes step N. ``WorkerFlush`` finishes
what is left when the executor has nothing new to launch. Every rank finishes every step (its
own state needs the tokens); only the output rank sends results back.

A grammar bitmask may come by reference (its buffer of ``SharedMasks``, which the
multiprocess executor's workers map): its rows are read from there when the step samples.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque

from octavo.config import EngineConfig
from octavo.messages import GrammarBitmask
from octavo.messages.executor import (
    WorkerCall,
    WorkerCallResult,
    WorkerEvent,
    WorkerFlush,
    WorkerInput,
    WorkerSample,
    WorkerShutdown,
    WorkerStep,
    WorkerStepResult,
)
from octavo.messages.shared_masks import SharedMasks, carries_rows
from octavo.plugins import get_plugin_manager
from octavo.worker.async_output import StepOutput
from octavo.worker.worker import Worker, create_worker

logger = logging.getLogger(__name__)


class WorkerHost:
    """Serves ``WorkerInput`` messages for one rank; see the module docstring."""

    def __init__(self, config: EngineConfig, rank: int, distributed_init_method: str | None,
                 local_rank: int | None = None, shared_masks: SharedMasks | None = None) -> None:
        """``shared_masks``: the engine core's grammar masks mapped in this process, for
        bitmasks sent by reference (none: every bitmask must carry its rows)."""
        self._shared_masks = shared_masks
        self.worker: Worker = create_worker(config, get_plugin_manager(), rank=rank,
                                            distributed_init_method=distributed_init_method,
                                            local_rank=local_rank)
        self.rank = rank
        self._pending: deque[tuple[int, StepOutput]] = deque()
        # Steps launched with sampling_deferred whose WorkerSample has not come, oldest first.
        self._unsampled: deque[int] = deque()
        self.stopped = False

    @property
    def is_output_rank(self) -> bool:
        return self.worker.ranks.is_output_rank

    def handle(self, message: WorkerInput) -> list[WorkerEvent]:
        """Act on one message; return what to send back (maybe nothing)."""
        if isinstance(message, WorkerStep):
            return self._step(message)
        if isinstance(message, WorkerSample):
            return self._sample(message)
        if isinstance(message, WorkerFlush):
            return self._finish_until(message.step_id)
        if isinstance(message, WorkerCall):
            return [self._call(message)]
        if isinstance(message, WorkerShutdown):
            self.shutdown()
            return []
        raise AssertionError(f"unexpected worker message {message!r}")

    def _call(self, call: WorkerCall) -> WorkerCallResult:
        worker = self.worker
        try:
            value = None
            if call.method == "start":
                worker.init_device()
                worker.init_distributed()
                worker.load_model()
                if self._shared_masks is not None:
                    worker.use_grammar_mask_buffers(self._shared_masks.array)
            elif call.method == "determine_num_blocks":
                value = worker.determine_num_blocks()
            elif call.method == "initialize_cache":
                assert call.arg is not None, "initialize_cache needs the number of blocks"
                worker.initialize_cache(call.arg)
            elif call.method == "determine_num_host_blocks":
                value = worker.determine_num_host_blocks()
            elif call.method == "initialize_host_cache":
                assert call.arg is not None, "initialize_host_cache needs the number of blocks"
                worker.initialize_host_cache(call.arg)
            elif call.method != "check_health":
                raise ValueError(f"unknown worker method {call.method!r}")
            return WorkerCallResult(call_id=call.call_id, rank=self.rank, value=value)
        except Exception as exc:
            logger.exception("rank %d: %s failed", self.rank, call.method)
            return WorkerCallResult(call_id=call.call_id, rank=self.rank,
                                    error=f"{type(exc).__name__}: {exc}")

    def _step(self, step: WorkerStep) -> list[WorkerEvent]:
        try:
            scheduler_output = step.scheduler_output
            if scheduler_output.grammar_bitmask is not None:
                scheduler_output.grammar_bitmask = self._rows(scheduler_output.grammar_bitmask)
            pending = self.worker.execute_model_async(scheduler_output)
        except Exception as exc:
            return [self._failed(step.step_id, exc)]
        self._pending.append((step.step_id, pending))
        if step.scheduler_output.sampling_deferred:
            self._unsampled.append(step.step_id)
        done = step.step_id - 1
        if self._unsampled:
            # A step still waiting for its sample (this one was prepared ahead of it) is
            # finished by that sample message: its result needs the sampling.
            done = min(done, self._unsampled[0] - 1)
        return self._finish_until(done)

    def _sample(self, sample: WorkerSample) -> list[WorkerEvent]:
        if self._unsampled:
            self._unsampled.popleft()  # samples come in launch order
        try:
            bitmask = sample.grammar_bitmask
            self.worker.sample_tokens(None if bitmask is None else self._rows(bitmask))
        except Exception as exc:
            return [self._failed(sample.step_id, exc)]
        if self._pending and self._pending[-1][0] > sample.step_id:
            # The next step came first (prepared ahead) and could not finish this one; it is
            # launched now, so this step's results are read back while it runs.
            return self._finish_until(sample.step_id)
        return []

    def _rows(self, bitmask: GrammarBitmask) -> GrammarBitmask:
        """``bitmask`` with its rows (read from the shared masks when sent by reference)."""
        if self._shared_masks is not None:
            return self._shared_masks.resolve(bitmask)
        if not carries_rows(bitmask):
            raise ValueError("a grammar bitmask came by reference to shared masks this rank "
                             "does not map")
        return bitmask

    def _finish_until(self, step_id: int) -> list[WorkerEvent]:
        events: list[WorkerEvent] = []
        while self._pending and self._pending[0][0] <= step_id:
            done_id, pending = self._pending.popleft()
            try:
                output = pending.result()
            except Exception as exc:
                events.append(self._failed(done_id, exc))
                break
            if self.is_output_rank:
                events.append(WorkerStepResult(step_id=done_id, rank=self.rank, output=output))
        return events

    def _failed(self, step_id: int, exc: Exception) -> WorkerStepResult:
        logger.error("rank %d: step %d failed:\n%s", self.rank, step_id, traceback.format_exc())
        self.stopped = True  # its state (and its peers') cannot be trusted: it stops serving
        return WorkerStepResult(step_id=step_id, rank=self.rank,
                                error=f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        if self.stopped and self.worker.model_runner is None:
            return
        self.stopped = True
        self._pending.clear()
        self._unsampled.clear()
        self.worker.shutdown()
