"""A rank that dies mid-generation fails the step at once (no hang), takes the other ranks
down with it, and leaves no process behind; the multiprocess executor's plumbing on a model
split in two."""

from __future__ import annotations

import os
import signal
import time

import pytest
from octavo.executor.multiproc import WorkerDiedError

from tests.helpers.engine import greedy, make_llm


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("victim, spin_us", [(0, "0"), (1, "0"), (1, "3000")])
def test_killing_a_rank_fails_the_step_and_stops_every_worker(tiny_llama, monkeypatch, victim,
                                                              spin_us):
    """Also with both ends polling their sockets between messages (``OCTAVO_WORKER_SPIN_US``)."""
    monkeypatch.setenv("OCTAVO_WORKER_SPIN_US", spin_us)
    llm = make_llm(tiny_llama, device="cpu", tensor_parallel_size=2)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    pids = [process.pid for process in executor._processes]
    try:
        for i in range(3):
            engine.add_request(str(i), {"prompt_token_ids": [5 + i, 6, 7]}, greedy(400))
        for _ in range(3):
            engine.step()  # running
        os.kill(pids[victim], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"worker rank {victim} exited"):
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "a worker process was left behind"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert not os.path.exists(executor._tmpdir)


def test_shutdown_ends_every_worker(tiny_llama):
    llm = make_llm(tiny_llama, device="cpu", pipeline_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    pids = [process.pid for process in executor._processes]
    assert len(llm.generate("Hello", greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    executor.check_health()
    llm.llm_engine.shutdown()
    assert not any(_alive(pid) for pid in pids)
    assert [p.exitcode for p in executor._processes] == [0, 0]  # told to stop, not killed


@pytest.mark.parametrize("value", ["-1", "busy"])
def test_a_bad_worker_spin_says_what_it_takes(monkeypatch, value):
    from octavo import envs

    monkeypatch.setenv("OCTAVO_WORKER_SPIN_US", value)
    with pytest.raises(ValueError, match="OCTAVO_WORKER_SPIN_US"):
        envs.worker_spin_s()
