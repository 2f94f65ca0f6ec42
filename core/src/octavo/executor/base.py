"""The ``Executor`` protocol: how the engine core drives the workers of one model.

An executor owns every worker of the model (one today; one per rank once the model is split
over devices) and hides where they run. The engine core calls exactly these methods, in this
order: ``initialize_kv_cache`` once (then ``initialize_swap_space`` once with
``--preemption-mode swap``), then ``execute_model`` / ``execute_model_async`` once per step
(followed by ``sample_tokens`` for a step launched with ``sampling_deferred``, before or,
when ``prepares_ahead``, after the next step's ``execute_model_async``;
``discard_in_flight`` after a failed step), ``check_health`` whenever asked, and ``shutdown``
last.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from octavo.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class PendingOutput(Protocol):
    """A launched step whose results may still be computing."""

    def result(self) -> ModelRunnerOutput:
        """Wait for the step and return its results (idempotent)."""
        ...


class Executor(Protocol):
    """Runs the model's workers for the engine core."""

    # Whether ``execute_model_async`` may come while the sampling of the step before it still
    # waits for ``sample_tokens``: the step is then prepared at once (its host work done
    # while the engine core waits for the grammar masks) and launched by ``sample_tokens``,
    # right after that sampling. Otherwise ``sample_tokens`` must come first.
    prepares_ahead: bool

    def initialize_kv_cache(self) -> int:
        """Size the KV cache on every worker, allocate it, and return the number of blocks
        (the same on every worker: the smallest any of them can hold)."""
        ...

    def initialize_swap_space(self) -> int:
        """Allocate the host KV block pool of swapped-out requests on every worker (``swap_space``
        GiB each) and return its number of blocks (the smallest any of them holds)."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion."""
        ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Launch one step and return before its sampled tokens are read back.

        Steps are launched in schedule order, and step N's result is taken before step N+2 is
        launched (at most one step in flight behind the one being launched).
        """
        ...

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        """Launch the sampling of the oldest step launched with ``sampling_deferred`` and not
        sampled yet, masked by ``grammar_bitmask`` (structured outputs under async
        scheduling). Called before that step's result is taken, and before the next step is
        launched unless ``prepares_ahead``."""
        ...

    def discard_in_flight(self) -> None:
        """Forget launched steps whose results will never be taken (after a failed step)."""
        ...

    def check_health(self) -> None:
        """Raise ``RuntimeError`` saying what is wrong when a worker is gone or broken."""
        ...

    def shutdown(self) -> None:
        """Release every worker and its device; idempotent."""
        ...


class StepWaiter(Protocol):
    """An executor whose steps run in other processes and come back by number."""

    def wait_step(self, step_id: int) -> ModelRunnerOutput: ...


class LaunchedStep:
    """A step launched on workers in other processes; ``result()`` waits for its answer."""

    def __init__(self, executor: StepWaiter, step_id: int) -> None:
        self._executor = executor
        self.step_id = step_id

    def result(self) -> ModelRunnerOutput:
        return self._executor.wait_step(self.step_id)


class UnsampledSteps:
    """The steps an executor of worker processes launched with ``sampling_deferred`` whose
    ``sample_tokens`` has not come yet, oldest first.

    Such executors prepare ahead: a rank finishes a step only after its sample message
    (``WorkerHost``), so the next step may be sent first and prepared on every rank while the
    engine core waits for the grammar masks. The sample message then names the step before
    the last one sent. With pipeline stages no step is launched with ``sampling_deferred`` (a
    request is not scheduled while its token is in flight), so there is nothing to prepare
    ahead of, and those executors say ``prepares_ahead = False``.
    """

    def __init__(self) -> None:
        self._ids: deque[int] = deque()

    def launched(self, step_id: int, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.sampling_deferred:
            self._ids.append(step_id)

    def next_to_sample(self, last_step_sent: int) -> int:
        """The step ``sample_tokens`` is for (the last one sent when none waits: the workers
        then have nothing to sample)."""
        return self._ids.popleft() if self._ids else last_step_sent

    def clear(self) -> None:
        self._ids.clear()
