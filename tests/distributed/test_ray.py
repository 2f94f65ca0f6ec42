"""The Ray executor on a local Ray instance started by the test (what `ray start --head` gives
a user, in this process): one actor per rank, the same outputs as one device, failures that
surface at once, and no actor or placement group left behind."""

from __future__ import annotations

import os
import time

import pytest

from tests.distributed.test_equivalence import (
    STRESS,
    assert_same,
    launches_ahead,
    mixed_requests,
    outputs_of,
    reference,
    run,
)
from tests.helpers.engine import assert_no_leaks, greedy, make_llm

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def _actor_processes() -> list[int]:
    """Pids of live processes running a rank's actor."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"_RayWorker" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _placement_groups() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [pg["state"] for pg in placement_group_table().values() if pg["state"] != "REMOVED"]


def _wait_gone(timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _actor_processes() or _placement_groups():
        assert time.monotonic() < deadline, (_actor_processes(), _placement_groups())
        time.sleep(0.2)


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_ray_equals_one_device(ray_instance, tiny_llama, split):
    llm = make_llm(tiny_llama, device="cpu", distributed_executor_backend="ray", **split,
                   **STRESS)
    try:
        assert type(llm.llm_engine.engine_core.executor).__name__ == "RayExecutor"
        assert_same(run(llm), reference(tiny_llama))
    finally:
        llm.llm_engine.shutdown()
    _wait_gone()


def test_a_dead_actor_fails_the_step_and_leaves_nothing(ray_instance, tiny_llama):
    from octavo.executor.multiproc import WorkerDiedError

    llm = make_llm(tiny_llama, device="cpu", distributed_executor_backend="ray",
                   tensor_parallel_size=2)
    engine = llm.llm_engine
    try:
        engine.add_request("0", {"prompt_token_ids": [5, 6, 7]}, greedy(400))
        for _ in range(3):
            engine.step()
        ray.kill(engine.engine_core.executor._actors[1], no_restart=True)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="Ray worker rank 1 died"):
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - started < 30
    finally:
        engine.shutdown()
    _wait_gone()


def test_ray_structured_outputs_with_the_next_step_prepared_ahead(ray_instance, tiny_llama):
    """As over worker processes (``test_equivalence``): the next step goes to the actors before
    the sampling of the one before it, and the outputs are one device's."""
    params = mixed_requests()
    one = make_llm(tiny_llama, device="cpu")
    want = outputs_of(one, params)
    one.llm_engine.shutdown()
    llm = make_llm(tiny_llama, device="cpu", distributed_executor_backend="ray",
                   tensor_parallel_size=2, async_scheduling=True, **STRESS)
    try:
        assert llm.llm_engine.engine_core.executor.prepares_ahead
        ahead = launches_ahead(llm)
        got = outputs_of(llm, params)
        assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]
        assert any(ahead)
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
    _wait_gone()
