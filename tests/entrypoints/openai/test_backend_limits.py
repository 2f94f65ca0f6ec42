"""A request beyond what the server's backend supports is a 400 OpenAI error object.

The server runs on ``tests.helpers.restricted_backend`` (at most 128 tokens per sequence, no
prompt logprobs, at most 2 top logprobs), installed for the server's processes the way any
plugin is: an ``octavo`` entry point, here a dist-info written into a temporary folder on
``PYTHONPATH`` (the engine core runs in a child process, so registering a plugin in this
process would not reach it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess, wait_idle
from tests.helpers import restricted_backend

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def restricted_server(tiny_model: Path, tmp_path_factory):
    folder = restricted_backend.write_entry_point(tmp_path_factory.mktemp("restricted-plugin"))
    path = os.pathsep.join([str(folder), str(REPO), os.environ.get("PYTHONPATH", "")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", path)
        srv = ServerProcess(tiny_model, "--device", "restricted", "--max-num-seqs", "8",
                            api_key=None)
    try:
        yield srv
    finally:
        assert srv.stop(signal.SIGTERM) == 0


@pytest.fixture(scope="module")
def http(restricted_server: ServerProcess):
    with httpx.Client(base_url=restricted_server.url, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def nothing_left_behind(restricted_server, http):
    """After every test: a plain request still works and every KV block is free."""
    yield
    resp = http.post("/v1/completions", json=_completion(max_tokens=2))
    assert resp.status_code == 200, resp.text
    m = wait_idle(restricted_server)
    assert m["octavo:kv_cache_usage_perc"] == 0 and m["octavo:num_requests_running"] == 0


def _completion(**fields) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello world", "max_tokens": 4, **fields}


def _error(resp: httpx.Response, param: str | None) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


def test_the_backends_context_is_the_servers(http) -> None:
    (card,) = [m for m in http.get("/v1/models").json()["data"] if m["id"] == SERVED_NAME]
    assert card["max_model_len"] == 128  # the tiny model allows 512; the backend 128
    resp = http.post("/v1/completions", json=_completion(prompt=[20] * 100, max_tokens=40))
    message = _error(resp, "max_tokens")
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens, but 140 were requested" in message


@pytest.mark.parametrize("stream", [False, True])
def test_more_logprobs_than_the_backend_gives(http, stream) -> None:
    resp = http.post("/v1/completions", json=_completion(logprobs=3, stream=stream))
    message = _error(resp, "logprobs")
    assert resp.json()["error"]["code"] == "unsupported_by_backend"
    assert message == ("logprobs must be at most 2 on backend 'restricted' (the most it "
                       "returns per token), got 3")


def test_chat_top_logprobs_beyond_the_backend(http) -> None:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "logprobs": True, "top_logprobs": 5}
    message = _error(http.post("/v1/chat/completions", json=body), "top_logprobs")
    assert message.startswith("top_logprobs must be at most 2 on backend 'restricted'")
    assert message.endswith("got 5")


def test_prompt_logprobs_on_a_backend_without_them(http) -> None:
    message = _error(http.post("/v1/completions", json=_completion(prompt_logprobs=1)),
                     "prompt_logprobs")
    assert message.startswith("prompt_logprobs are not supported by backend 'restricted'")


def test_within_the_limits_the_request_runs(http) -> None:
    resp = http.post("/v1/completions", json=_completion(logprobs=2, temperature=0.0))
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
