"""``WorkerHost``'s order of work on one rank, with a stand-in worker: a step launched with its
sampling deferred is finished only after its sample message, whether the next step comes
before that message (the executor prepares ahead) or after it; a flush of a step never sampled
fails that step at once instead of waiting; a bitmask sent by reference reaches the worker
with its rows, read from the shared masks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from octavo.executor import worker_host
from octavo.messages import ModelRunnerOutput, SchedulerOutput
from octavo.messages.shared_masks import SharedMasks, by_reference
from octavo.messages.executor import (
    WorkerFlush,
    WorkerSample,
    WorkerStep,
    WorkerStepResult,
)


class _Step:
    """A launched step: its result is there once its sampling (if deferred) was launched."""

    def __init__(self, step_id: int, deferred: bool) -> None:
        self.step_id = step_id
        self.sampled = not deferred

    def result(self) -> ModelRunnerOutput:
        if not self.sampled:
            raise RuntimeError("the step's sampling was never launched (sample_tokens)")
        return ModelRunnerOutput(req_ids=[f"step-{self.step_id}"])


class _Worker:
    """Stands for ``Worker``: records the calls; ``sample_tokens`` samples the oldest
    deferred step."""

    def __init__(self) -> None:
        self.ranks = SimpleNamespace(is_output_rank=True)
        self.calls: list[str] = []
        self.steps: list[_Step] = []
        self.model_runner = object()
        self.bitmasks: list = []  # every bitmask seen, as the runner would read it

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> _Step:
        if scheduler_output.grammar_bitmask is not None:
            self.bitmasks.append(bytes(scheduler_output.grammar_bitmask.data))
        step = _Step(len(self.steps) + 1, scheduler_output.sampling_deferred)
        self.steps.append(step)
        self.calls.append(f"launch {step.step_id}")
        return step

    def sample_tokens(self, grammar_bitmask) -> None:
        if grammar_bitmask is not None:
            self.bitmasks.append(bytes(grammar_bitmask.data))
        step = next(s for s in self.steps if not s.sampled)
        step.sampled = True
        self.calls.append(f"sample {step.step_id}")

    def shutdown(self) -> None:
        self.model_runner = None


@pytest.fixture
def make_host(monkeypatch):
    monkeypatch.setattr(worker_host, "create_worker", lambda *a, **k: _Worker())
    monkeypatch.setattr(worker_host, "get_plugin_manager", lambda: None)

    def make(shared_masks: SharedMasks | None = None) -> worker_host.WorkerHost:
        return worker_host.WorkerHost(config=None, rank=0, distributed_init_method=None,
                                      shared_masks=shared_masks)

    return make


@pytest.fixture
def host(make_host) -> worker_host.WorkerHost:
    return make_host()


def step(step_id: int, deferred: bool) -> WorkerStep:
    return WorkerStep(step_id=step_id, scheduler_output=SchedulerOutput(
        total_num_scheduled_tokens=1, sampling_deferred=deferred))


def finished(events) -> list[int]:
    assert all(isinstance(e, WorkerStepResult) and e.error is None for e in events), events
    return [e.step_id for e in events]


def test_the_next_step_before_the_sample_message(host) -> None:
    """Prepared ahead: step 2 comes before step 1's sample; step 1 is finished by that sample
    message, right after its sampling launched step 2 on the device."""
    assert finished(host.handle(step(1, deferred=True))) == []
    assert finished(host.handle(step(2, deferred=True))) == []  # step 1 still unsampled
    assert finished(host.handle(WorkerSample(step_id=1))) == [1]
    assert finished(host.handle(step(3, deferred=False))) == []  # step 2 still unsampled
    assert finished(host.handle(WorkerSample(step_id=2))) == [2]
    assert finished(host.handle(WorkerFlush(step_id=3))) == [3]
    assert host.worker.calls == ["launch 1", "launch 2", "sample 1", "launch 3", "sample 2"]


def test_the_sample_message_before_the_next_step(host) -> None:
    """The old order: the sample message finishes nothing (no step after it yet); the next
    step finishes it."""
    assert finished(host.handle(step(1, deferred=True))) == []
    assert finished(host.handle(WorkerSample(step_id=1))) == []
    assert finished(host.handle(step(2, deferred=False))) == [1]
    assert finished(host.handle(WorkerFlush(step_id=2))) == [2]


def test_a_flush_of_a_step_never_sampled_fails_it_at_once(host) -> None:
    host.handle(step(1, deferred=True))
    (event,) = host.handle(WorkerFlush(step_id=1))
    assert isinstance(event, WorkerStepResult) and event.step_id == 1
    assert "never launched" in event.error
    assert host.stopped


def test_a_bitmask_by_reference_is_read_from_the_shared_masks(make_host) -> None:
    """In a step (masks wanted at once) and in a sample message, the worker gets the rows the
    engine core's side wrote into the shared buffers, not the empty reference."""
    masks = SharedMasks.create(max_rows=4, vocab_size=64)  # 2 words a row
    try:
        masks.array[0, :2] = [[1, 2], [3, 4]]
        masks.array[1, :1] = [[5, 6]]
        host = make_host(masks)
        first = WorkerStep(step_id=1, scheduler_output=SchedulerOutput(
            total_num_scheduled_tokens=2,
            grammar_bitmask=by_reference(masks.bitmask(0, ["a", "b"]))))
        assert finished(host.handle(first)) == []
        assert finished(host.handle(step(2, deferred=True))) == [1]
        sample = WorkerSample(step_id=2, grammar_bitmask=by_reference(masks.bitmask(1, ["a"])))
        assert len(sample.grammar_bitmask.data) == 0
        host.handle(sample)
        assert host.worker.bitmasks == [np.array([[1, 2], [3, 4]], "<i4").tobytes(),
                                        np.array([[5, 6]], "<i4").tobytes()]
    finally:
        masks.close()


def test_a_bitmask_by_reference_without_shared_masks_fails_the_step(host) -> None:
    masks = SharedMasks.create(max_rows=4, vocab_size=64)
    try:
        host.handle(step(1, deferred=True))
        (event,) = host.handle(WorkerSample(
            step_id=1, grammar_bitmask=by_reference(masks.bitmask(0, ["a"]))))
    finally:
        masks.close()
    assert isinstance(event, WorkerStepResult) and event.step_id == 1
    assert "shared masks this rank does not map" in event.error
    assert host.stopped
