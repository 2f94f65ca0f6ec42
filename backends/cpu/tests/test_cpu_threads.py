"""The CPU worker's thread plan and the calling thread's pinning during steps."""

from __future__ import annotations

import os
import threading

import pytest
import torch
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


@needs_affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity")
                    else True, reason="needs two cores")
def test_the_user_process_pins_its_calling_thread_during_steps_only(monkeypatch):
    """In the user's process (not an engine or worker process of its own) the worker threads
    are pinned for good and the calling thread gets a step CPU; OCTAVO_CPU_PIN_STEPS=0: none."""
    from octavo_cpu.kernels import load_kernels
    from octavo_cpu.threads import allowed_cpus, configure_threads

    if load_kernels() is None:
        pytest.skip("no C++ kernels here (their tests say why)")
    threads = torch.get_num_threads()
    before = os.sched_getaffinity(0)
    try:
        plan = configure_threads(2, world_size=1, local_rank=0)
        assert plan.step_cpu == allowed_cpus()[0]
        assert os.sched_getaffinity(0) == before  # the calling thread itself stays free
        monkeypatch.setenv("OCTAVO_CPU_PIN_STEPS", "0")
        assert configure_threads(2, world_size=1, local_rank=0).step_cpu is None
    finally:
        torch.set_num_threads(threads)
