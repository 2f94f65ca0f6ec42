"""How many threads a CPU worker computes with, and on which cores.

The count, in order of precedence:

1. ``--cpu-threads N`` (``LLM(cpu_threads=N)``);
2. ``OMP_NUM_THREADS``, which torch read when it started;
3. the cores this process may run on (``os.sched_getaffinity``) divided by the ranks of a split
   model, so two ranks on one host do not each take every core.

Then each of torch's OpenMP threads is pinned to one of those cores (rank ``r`` of a split
model takes the ``r``-th group of ``N`` cores), so the threads do not migrate or pile up on one
core. The calling thread (OpenMP thread 0) is pinned only in a process of its own (the engine
core's process of ``octavo serve``/``AsyncLLM``, an ``mp`` worker): in the user's process
(``LLM``) it stays free, since threads and processes it starts later would inherit its mask.
Nothing is pinned when there are fewer cores than threads, or without the C++ kernels.

Left free, the calling thread still has to run on its own core while it computes: waking it
from a parallel region's barrier, Linux's wake-affine heuristic tends to place it on the core
of the thread that woke it, i.e. beside a pinned OpenMP thread, and the two then share one core
(every region waits for a time slice) while the other core idles. So in the user's process the
calling thread is pinned to the first planned core for the duration of each step only
(``step_pinning``, the worker wraps its steps in it) and its own mask is restored after; two
``sched_setaffinity`` calls a step. ``OCTAVO_CPU_PIN_STEPS=0`` turns this off (comparisons).

The API server's process computes nothing: ``octavo serve`` gives its torch one thread
(``octavo.cli.serve``), so it does not compete with the engine core for the cores.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from dataclasses import dataclass

import torch
from octavo import envs

from octavo_cpu.kernels import load_kernels

logger = logging.getLogger("octavo.cpu.threads")  # under the octavo tree


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """The threads one worker uses."""

    # torch threads (torch.set_num_threads).
    num_threads: int
    # Where the number came from: "cpu_threads", "OMP_NUM_THREADS" or "cores".
    source: str
    # The CPUs thread t is pinned to (empty: not pinned).
    cpus: tuple[int, ...]
    # The CPU the calling thread is pinned to during each step only (None: not done, as it is
    # pinned for good, nothing is pinned, or OCTAVO_CPU_PIN_STEPS=0).
    step_cpu: int | None = None


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_threads(cpu_threads: int | None, world_size: int, local_rank: int,
                 cpus: list[int] | None = None) -> ThreadPlan:
    """The thread count and cores of rank ``local_rank`` of ``world_size`` on this host."""
    cpus = allowed_cpus() if cpus is None else cpus
    if cpu_threads is not None:
        num, source = cpu_threads, "cpu_threads"
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        num, source = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        num, source = max(1, len(cpus) // max(1, world_size)), "cores"
    first = local_rank * num
    pinned = tuple(cpus[first:first + num]) if first + num <= len(cpus) else ()
    return ThreadPlan(num, source, pinned)


def configure_threads(cpu_threads: int | None, world_size: int, local_rank: int) -> ThreadPlan:
    """Set torch's thread count and pin the threads (see the module docstring)."""
    plan = plan_threads(cpu_threads, world_size, local_rank)
    torch.set_num_threads(plan.num_threads)
    bound: list[int] = []
    kernels = load_kernels() if plan.cpus else None
    if kernels is not None and kernels.bind_threads_op is not None:
        own_process = multiprocessing.current_process().name != "MainProcess"
        bound = list(kernels.bind_threads_op(list(plan.cpus), own_process))
    pinned = [cpu for cpu in bound if cpu >= 0]
    step_cpu = None
    if (bound and bound[0] < 0 and any(cpu >= 0 for cpu in bound[1:])
            and hasattr(os, "sched_setaffinity")
            and envs.cpu_pin_steps()):
        step_cpu = plan.cpus[0]
    logger.info("cpu threads: %d (from %s)%s%s", plan.num_threads, plan.source,
                f", pinned to CPUs {pinned}" if pinned else ", not pinned",
                f" (the calling thread to CPU {step_cpu} during steps)"
                if step_cpu is not None else "")
    return ThreadPlan(plan.num_threads, plan.source, plan.cpus, step_cpu)


class step_pinning:  # noqa: N801 (used as a context manager, like contextlib's)
    """Pins the calling thread to ``cpu`` inside the ``with`` block, then restores its mask
    (``cpu`` None: does nothing). Linux applies a mask to the calling thread alone."""

    __slots__ = ("cpu", "_saved")

    def __init__(self, cpu: int | None) -> None:
        self.cpu = cpu
        self._saved: set[int] | None = None

    def __enter__(self) -> None:
        if self.cpu is None:
            return
        saved = os.sched_getaffinity(0)
        if saved != {self.cpu}:
            os.sched_setaffinity(0, {self.cpu})
            self._saved = saved

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            os.sched_setaffinity(0, self._saved)
            self._saved = None
