"""Admission cap, SIGTERM with requests in flight, and the engine process dying."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import (
    API_KEY,
    SERVED_NAME,
    ServerProcess,
    metrics,
    pid_alive,
)


def stream_all(server: ServerProcess, body: dict, started: threading.Event, out: dict) -> None:
    """Stream a completion to its end; record the text, the usage and whether [DONE] came."""
    text, done = "", False
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        text += chunk["choices"][0]["text"]
                        started.set()
                    if chunk.get("usage"):
                        out["completion_tokens"] = chunk["usage"]["completion_tokens"]
    out.update(text=text, done=done)
    started.set()


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_waiting_cap_then_sigterm_lets_requests_finish(long_context_model) -> None:
    server = ServerProcess(long_context_model, "--max-num-seqs", "1",
                           "--max-waiting-requests", "1", "--shutdown-timeout", "60")
    try:
        # Long enough that the first request still runs when the third arrives: 150 and then
        # 500 tokens each once finished first on a faster engine (the second then ran, nothing
        # waited, and the third was admitted). 4,000 take over a second.
        max_tokens = 4000
        body = {"model": SERVED_NAME, "prompt": "Hello world", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        outs = [{}, {}]
        events = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=stream_all, args=(server, body, events[i], outs[i])) for i in range(2)]
        threads[0].start()
        assert events[0].wait(30)  # the first runs (max_num_seqs 1)...
        threads[1].start()          # ...the second waits...
        wait_for(lambda: metrics(server)["octavo:num_requests_waiting"] == 1)
        resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers())
        assert resp.status_code == 503, resp.text   # ...and the third is refused
        assert resp.json()["error"]["code"] == "overloaded"
        assert httpx.get(f"{server.url}/health").status_code == 200

        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.wait_exit(60) == 0
        for out in outs:  # both in-flight requests completed
            assert out["status"] == 200 and out["done"] and out["completion_tokens"] == max_tokens
    finally:
        server.kill()


def test_engine_death_fails_requests_then_exits_nonzero(tiny_model) -> None:
    server = ServerProcess(tiny_model)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        stream = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=480,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # the request is running
        os.kill(server.engine_core_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine"):
            for _ in stream:
                pass
        statuses = []
        try:
            while True:
                statuses.append(httpx.get(f"{server.url}/health", timeout=5).status_code)
                if statuses[-1] == 503:
                    break
                time.sleep(0.01)
        except httpx.TransportError:
            pass
        assert 503 in statuses, statuses
        code = server.wait_exit(60)
        assert code != 0, server.read_log()
    finally:
        server.kill()


def test_engine_core_exits_when_the_server_is_killed(tiny_model) -> None:
    """SIGKILL leaves the API process no chance to clean up: the core notices on its own."""
    def ipc_dirs() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("octavo-core-*"))

    before = ipc_dirs()
    server = ServerProcess(tiny_model)
    try:
        ours = ipc_dirs() - before
        assert len(ours) == 1
        core_pid = server.engine_core_pid
        server.proc.kill()
        server.proc.wait(10)
        wait_for(lambda: not pid_alive(core_pid), timeout_s=15)
        server.assert_no_orphans()
        assert not any(d.exists() for d in ours), "the ipc socket folder was left behind"
    finally:
        server.kill()
