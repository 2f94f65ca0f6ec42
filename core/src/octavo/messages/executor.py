"""Messages between an executor and the worker processes (or Ray actors) of a split model.

msgspec Structs, encoded as msgpack (never pickle): the ``SchedulerOutput`` and
``ModelRunnerOutput`` dataclasses travel as they are, so the request data crossing a process
boundary is plain typed data.

- executor -> every worker: ``WorkerCall`` (a lifecycle method), ``WorkerStep`` (run a step),
  ``WorkerSample`` (sample a step launched with ``sampling_deferred``, with its grammar
  bitmask: the last one sent, or with the step after it prepared ahead, the one before), ``WorkerFlush`` (send the results of steps up to one), ``WorkerShutdown``.
- worker -> executor: ``WorkerCallResult`` (every rank), ``WorkerStepResult`` (the output
  rank only, or any rank whose step failed).
"""

from __future__ import annotations

import msgspec

from octavo.messages.runner_output import ModelRunnerOutput
from octavo.messages.scheduler_output import GrammarBitmask, SchedulerOutput

# The lifecycle methods a WorkerCall may name, in the order an executor calls them.
WORKER_METHODS = ("start", "determine_num_blocks", "initialize_cache", "determine_num_host_blocks",
                  "initialize_host_cache", "check_health")


class WorkerCall(msgspec.Struct, tag="call", kw_only=True):
    """Call one lifecycle method on every rank and collect every rank's answer."""

    # Matches the answers to the call.
    call_id: int
    # One of WORKER_METHODS: "start" (bind the device, join the ranks, load this rank's
    # weights), "determine_num_blocks", "initialize_cache" (arg: the number of blocks),
    # "determine_num_host_blocks", "initialize_host_cache" (arg: the number of host blocks),
    # "check_health".
    method: str
    # The method's one integer argument, if it takes one.
    arg: int | None = None


class WorkerStep(msgspec.Struct, tag="step", kw_only=True):
    """Launch one step (steps are numbered from 1, in the order they are sent)."""

    step_id: int
    scheduler_output: SchedulerOutput


class WorkerSample(msgspec.Struct, tag="sample", kw_only=True):
    """Sample step ``step_id``, launched with ``sampling_deferred``: the last step sent, or
    the one before it when the executor prepared the next step ahead of this sampling."""

    step_id: int
    grammar_bitmask: GrammarBitmask | None = None


class WorkerFlush(msgspec.Struct, tag="flush", kw_only=True):
    """Finish every launched step up to ``step_id`` and send their results now (the executor
    waits for one and has no later step to launch)."""

    step_id: int


class WorkerShutdown(msgspec.Struct, tag="shutdown"):
    """Release the device and the process group, then exit 0."""


WorkerInput = WorkerCall | WorkerStep | WorkerSample | WorkerFlush | WorkerShutdown


class WorkerCallResult(msgspec.Struct, tag="call_result", kw_only=True):
    """One rank's answer to a ``WorkerCall``."""

    call_id: int
    rank: int
    # The method's result (an integer for determine_num_blocks / determine_num_host_blocks),
    # None otherwise or on error.
    value: int | None = None
    # What went wrong (exception type and message), None on success.
    error: str | None = None


class WorkerStepResult(msgspec.Struct, tag="step_result", kw_only=True):
    """A step's results from the output rank, or a failed step from any rank."""

    step_id: int
    rank: int
    output: ModelRunnerOutput | None = None
    error: str | None = None


WorkerEvent = WorkerCallResult | WorkerStepResult
