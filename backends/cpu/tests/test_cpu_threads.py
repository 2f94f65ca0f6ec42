"""The CPU worker's thread plan and the calling thread's pinning during steps."""

from __future__ import annotations

import os
import threading

import pytest
from octavo_cpu.threads import plan_threads, step_pinning

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                    reason="no sched_setaffinity on this platform")


def test_plan_takes_the_ranks_group_of_cores():
    plan = plan_threads(2, world_size=2, local_rank=1, cpus=[0, 1, 2, 3])
    assert (plan.num_threads, plan.source, plan.cpus, plan.step_cpu) == (
        2, "cpu_threads", (2, 3), None)
    assert plan_threads(4, world_size=1, local_rank=0, cpus=[0, 1]).cpus == ()


@needs_affinity
def test_step_pinning_pins_the_calling_thread_and_restores_its_mask():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    seen_by_other_thread = []
    with step_pinning(cpu):
        assert os.sched_getaffinity(0) == {cpu}
        other = threading.Thread(target=lambda: seen_by_other_thread.append(
            os.sched_getaffinity(0)))
        other.start()
        other.join()
    assert os.sched_getaffinity(0) == before
    # A thread started inside the block inherits the mask of the moment; threads started
    # outside are untouched (only the calling thread is pinned, and only for the block).
    assert seen_by_other_thread == [{cpu}]


@needs_affinity
def test_step_pinning_restores_the_mask_on_errors_and_none_does_nothing():
    before = os.sched_getaffinity(0)
    with pytest.raises(ValueError):
        with step_pinning(min(before)):
            raise ValueError("step failed")
    assert os.sched_getaffinity(0) == before
    with step_pinning(None):
        assert os.sched_getaffinity(0) == before
