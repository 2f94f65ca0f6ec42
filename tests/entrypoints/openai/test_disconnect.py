"""A client that goes away mid-request: the request is aborted and its KV blocks freed."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.openai.conftest import SERVED_NAME, metrics, wait_idle

ABORTED = 'octavo:request_success_total{finished_reason="abort"}'
LONG = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True}


def test_disconnect_mid_stream_frees_blocks(server) -> None:
    before = metrics(server)
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            received = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    received += 1
                    json.loads(line[6:])
                if received == 3:
                    mid = metrics(server)
                    assert mid["octavo:num_requests_running"] == 1
                    assert mid["octavo:kv_cache_usage_perc"] > 0
                    break  # leaving the block closes the connection
    after = wait_idle(server)
    assert after["octavo:kv_cache_usage_perc"] == 0
    assert after["octavo:num_requests_running"] == 0 and after["octavo:num_requests_waiting"] == 0
    assert after[ABORTED] == before[ABORTED] + 1
    generated = after["octavo:generation_tokens_total"] - before["octavo:generation_tokens_total"]
    assert generated < 480, "the request ran to its end instead of being aborted"


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {**{k: v for k, v in LONG.items() if k != "prompt"},
                              "messages": [{"role": "user", "content": "Once upon a time"}]}),
])
def test_disconnect_while_waiting_for_a_full_response(server, endpoint, body) -> None:
    before = metrics(server)
    with httpx.Client(base_url=server.url, headers=server.headers()) as http:
        with pytest.raises(httpx.ReadTimeout):
            # 480 tokens take ~0.15 s on the tiny model (2-core CPU): the client gives up well
            # before the response is ready.
            http.post(endpoint, json=body, timeout=httpx.Timeout(60, read=0.03))
    after = wait_idle(server)
    assert after["octavo:kv_cache_usage_perc"] == 0 and after["octavo:num_requests_running"] == 0
    assert after[ABORTED] == before[ABORTED] + 1
    assert after["octavo:generation_tokens_total"] - before["octavo:generation_tokens_total"] < 480
