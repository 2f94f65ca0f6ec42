"""Every error case: its status and an OpenAI error object; the server stays healthy after."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import MAX_BODY_BYTES, SERVED_NAME, wait_idle

VOCAB = 384  # tests/helpers/tiny.py
MAX_MODEL_LEN = 512


def completion(**fields):
    body = {"model": SERVED_NAME, "prompt": "Hello world", "max_tokens": 4}
    body.update(fields)
    return body


def assert_error(resp: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error


@pytest.fixture(autouse=True)
def still_healthy(server, http):
    """After every test: /health 200, nothing left in the engine, a request still works."""
    yield
    assert httpx.get(f"{server.url}/health").status_code == 200
    resp = http.post("/v1/completions", json=completion())
    assert resp.status_code == 200, resp.text
    m = wait_idle(server)
    assert m["octavo:kv_cache_usage_perc"] == 0 and m["octavo:num_requests_running"] == 0


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3, "n": 4}, "best_of"),  # best_of must be >= n
    ({"frobnicate": 1}, "frobnicate"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
])
def test_unsupported_fields_are_named(http, fields, param) -> None:
    assert_error(http.post("/v1/completions", json=completion(**fields)), 400, param=param, contains=param)


def test_unsupported_chat_fields_are_named(http) -> None:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
            "audio": {"voice": "alloy"}, "prediction": {"type": "content", "content": "x"}}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param="audio")
    assert "audio" in error["message"] and "prediction" in error["message"]
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
            "functions": [{"name": "f"}], "function_call": "auto"}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param="functions")
    assert "functions" in error["message"] and "function_call" in error["message"]
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function"}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="tools[0].function")
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, contains="image_url")
    body = {"model": SERVED_NAME, "messages": [{"role": "function", "content": "x"}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="messages[0].role")


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_invalid_values_are_400(http, fields, param) -> None:
    assert_error(http.post("/v1/completions", json=completion(**fields)), 400, param=param)


def test_validation_errors_are_400_not_422(http) -> None:
    assert_error(http.post("/v1/completions", json={"model": SERVED_NAME}), 400, param="prompt")
    resp = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(resp, 400, contains="JSON")
    assert_error(http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": "hi"}), 400)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [5, VOCAB]}, "prompt"),
    ({"prompt": [[5, 6], [-1]]}, "prompt[1]"),
    ({"logit_bias": {str(VOCAB + 5): 1}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1] * (MAX_MODEL_LEN - 3), "max_tokens": 4}, "max_tokens"),
    ({"prompt": [1] * MAX_MODEL_LEN}, "prompt"),
])
def test_bad_input_never_reaches_the_engine(http, fields, param) -> None:
    assert_error(http.post("/v1/completions", json=completion(**fields)), 400, param=param)


def test_chat_too_long_and_stream_variant(http) -> None:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="max_completion_tokens",
                 contains="maximum context length")
    body = completion(prompt=[VOCAB + 1], stream=True)
    assert_error(http.post("/v1/completions", json=body), 400, param="prompt")


def test_api_key(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        resp = httpx.post(f"{server.url}/v1/completions", json=completion(), headers=headers)
        error = assert_error(resp, 401)
        assert error["code"] == "invalid_api_key"
        assert_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_model_and_route(client, http) -> None:
    error = assert_error(http.post("/v1/completions", json=completion(model="gpt-4")), 404, param="model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_body_over_the_limit_is_413(http) -> None:
    resp = http.post("/v1/completions", json=completion(prompt="a" * (MAX_BODY_BYTES + 10)))
    assert_error(resp, 413, contains=str(MAX_BODY_BYTES))

    def chunks():  # no Content-Length: the limit applies to what is actually sent
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1000 + 1):
            yield b"a" * 1000
        yield b'"}'

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(resp, 413)


def test_openai_client_raises_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=4, extra_body={"bogus": 1})
    assert "bogus" in str(info.value)


def test_models_version_docs(http) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]][0] == SERVED_NAME
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/version").json()["version"]
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= set(paths)
