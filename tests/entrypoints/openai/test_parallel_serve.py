"""`octavo serve -tp 2` (two worker processes under the engine core): the `openai` client gets
what one device gives, and a worker that dies fails requests with an error, turns /health to
503 and makes the server exit non-zero with nothing left running."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess, descendants


@pytest.fixture(scope="module")
def split_server(tiny_model):
    server = ServerProcess(tiny_model, "--tensor-parallel-size", "2", "--device", "cpu")
    try:
        yield server
    finally:
        server.kill()


def _check_equals_one_device(server: ServerProcess, offline_llm) -> None:
    from octavo import SamplingParams

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    prompts = ["Hello world", "The capital of France is", "Once upon a time"]
    got = client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=10,
                                    temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    expected = offline_llm.generate(prompts, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, logprobs=1), use_tqdm=False)
    assert [c.text for c in got.choices] == [o.outputs[0].text for o in expected]
    for choice, output in zip(got.choices, expected):
        completion = output.outputs[0]
        want = [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)]
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=2e-4)


def test_tensor_parallel_completions_equal_one_device(split_server, offline_llm) -> None:
    _check_equals_one_device(split_server, offline_llm)


def test_pipeline_parallel_completions_equal_one_device(tiny_model, offline_llm) -> None:
    server = ServerProcess(tiny_model, "--pipeline-parallel-size", "2", "--device", "cpu")
    try:
        _check_equals_one_device(server, offline_llm)
    finally:
        code = server.stop()  # SIGTERM; checks that no worker process is left behind
    assert code == 0


def test_a_dead_worker_fails_requests_and_exits_nonzero(split_server) -> None:
    server = split_server
    workers = [pid for pid in descendants(server.engine_core_pid)
               if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(workers) == 2, workers
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=480,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # running
    started = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 15
    statuses = []
    try:
        while True:
            statuses.append(httpx.get(f"{server.url}/health", timeout=5).status_code)
            if statuses[-1] == 503:
                break
            time.sleep(0.02)
    except httpx.TransportError:
        pass
    assert 503 in statuses, statuses
    assert server.wait_exit(60) != 0  # also checks that no process was left behind
    assert "worker rank 1 exited" in server.read_log()
