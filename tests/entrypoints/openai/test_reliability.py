"""What a careless client or an attacker sends: every case gets a 4xx OpenAI error object (or
is served), the server keeps answering, and the queue and KV gauges return to 0.

Most cases run against the shared server; the admission cap, the API key from the environment
and the shutdown timeout need a server of their own (``capped``).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess, wait_idle

VOCAB = 384  # tests/helpers/tiny.py


def completion(**fields) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello world", "max_tokens": 4, **fields}


def chat(content: str, **fields) -> dict:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **fields}


def post_escaped(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON: lone surrogates travel as ``\\udXXX`` escapes, as a JSON
    client may legally send them (httpx's own encoder refuses to)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def assert_400(resp: httpx.Response, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(server: ServerProcess, http: httpx.Client) -> None:
    """A normal request still works, and nothing is left queued or holding KV blocks."""
    resp = http.post("/v1/completions", json=completion())
    assert resp.status_code == 200, resp.text
    m = wait_idle(server)
    assert m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
    assert m["octavo:kv_cache_usage_perc"] == 0


@pytest.fixture(autouse=True)
def _healthy_after(server, http):
    """After every test the shared server still serves and holds nothing."""
    yield
    assert_still_serving(server, http)


# ---- 2. numbers beyond 64 bits, 10. strict types --------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"top_k": 10**30}, "top_k"),
    ({"n": 10**30}, "n"),
    ({"seed": 10**30}, "seed"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"logprobs": 10**30}, "logprobs"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids"),
    ({"logit_bias": {str(10**30): 1.0}}, "logit_bias"),
    ({"prompt": [5, 10**30]}, "prompt"),
])
def test_integers_beyond_64_bits_are_400(http, fields, param) -> None:
    assert_400(http.post("/v1/completions", json=completion(**fields)), param)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [[5, True]]}, "prompt"),
    ({"temperature": "0.5"}, "temperature"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"n": 1.0}, "n"),
    ({"stop_token_ids": [False]}, "stop_token_ids[0]"),
    ({"echo": "yes"}, "echo"),
])
def test_no_coercion_of_booleans_and_strings(http, fields, param) -> None:
    assert_400(http.post("/v1/completions", json=completion(**fields)), param)


def test_integers_are_numbers(http) -> None:
    resp = http.post("/v1/completions", json=completion(temperature=0, top_p=1))
    assert resp.status_code == 200, resp.text


# ---- 3. text that is not valid Unicode ------------------------------------------------------


def test_lone_surrogates_are_400_everywhere(http) -> None:
    bad = "Hello \ud800 world"
    cases = [
        ("/v1/completions", completion(prompt=bad), "prompt"),
        ("/v1/completions", completion(prompt=["ok", bad]), "prompt[1]"),
        ("/v1/completions", completion(stop=["\udfff"]), "stop"),
        ("/v1/chat/completions", chat(bad), "messages"),
        ("/tokenize", {"prompt": bad}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": bad}]}, "messages"),
    ]
    for path, body, param in cases:
        assert_400(post_escaped(http, path, body), param, "invalid_text")


# ---- 4. n, 5. stop strings --------------------------------------------------------------------


def test_n_is_capped_before_anything_is_made(http) -> None:
    started = time.monotonic()
    error = assert_400(http.post("/v1/completions", json=completion(n=100_000)), "n", "too_many")
    assert "at most 128" in error["message"] and time.monotonic() - started < 5
    error = assert_400(http.post("/v1/completions", json=completion(prompt=["a"] * 20, n=10)),
                       "prompt", "too_many")
    assert "200 completions" in error["message"]
    assert_400(http.post("/v1/completions", json=completion(best_of=200, n=200)), "n", "too_many")


def test_stop_strings_are_capped(http) -> None:
    many = [f"stop{i}" for i in range(129)]
    assert_400(http.post("/v1/completions", json=completion(stop=many)), "stop", "too_many")
    assert_400(http.post("/v1/completions", json=completion(stop=["x" * 1025])), "stop", "too_many")


def test_the_most_stop_strings_allowed_still_match(http, offline_llm) -> None:
    from octavo import SamplingParams

    body = completion(max_tokens=24, temperature=0, ignore_eos=True)
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    target = free[6:9]
    assert target, free
    stops = [f"never-{i}-" + "z" * 1000 for i in range(127)] + [target]
    resp = http.post("/v1/completions", json={**body, "stop": stops})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == free[: free.index(target)]
    expected = offline_llm.generate("Hello world", SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, stop=stops), use_tqdm=False)
    assert expected[0].outputs[0].text == choice["text"]


# ---- 6. prompt logprobs ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_are_returned(http, stream) -> None:
    body = completion(prompt=[5, 17, 42, 99], prompt_logprobs=2, stream=stream)
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        with_prompt = [c for c in chunks if c["choices"][0].get("prompt_logprobs")]
        assert len(with_prompt) == 1  # once, with the choice's first chunk
        positions = with_prompt[0]["choices"][0]["prompt_logprobs"]
    else:
        positions = resp.json()["choices"][0]["prompt_logprobs"]
    assert len(positions) == 4 and positions[0] is None
    for token_id, position in zip([17, 42, 99], positions[1:]):
        assert str(token_id) in position  # the actual prompt token, plus up to 2 top ones
        assert 1 <= len(position) <= 3
        entry = position[str(token_id)]
        assert entry["logprob"] <= 0 and entry["rank"] >= 1 and "decoded_token" in entry


# ---- 8. a malformed frame on an internal socket ----------------------------------------------


def test_a_malformed_frame_on_the_output_socket_is_dropped(server, http) -> None:
    import glob

    body = completion(max_tokens=64, temperature=0, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # the request is running
        context = zmq.Context()
        try:
            sent = 0
            for path in glob.glob("/tmp/octavo-core-*/output"):
                push = context.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 1000)
                push.connect(f"ipc://{path}")
                push.send(b"\xc1 not msgpack")
                push.send(msgspec.msgpack.encode({"type": "outputs", "outputs": 7}))
                push.close()
                sent += 1
            assert sent >= 1
        finally:
            context.term()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "dropped a malformed frame" in server.read_log()


# ---- 1. admission all or nothing, 9. the key from the environment, 7. shutdown -----------------


@pytest.fixture
def capped(long_context_model):
    server = ServerProcess(long_context_model, "--max-waiting-requests", "2", "--max-num-seqs", "1",
                           "--shutdown-timeout", "0", "--vllm-metric-names", api_key=None,
                           env={"OCTAVO_API_KEY": "from-env"})
    server.api_key = "from-env"  # what clients must send
    try:
        yield server
    finally:
        server.kill()


def test_capped_server(capped) -> None:
    """One server for three items (a server start costs seconds on two cores)."""
    with httpx.Client(base_url=capped.url, timeout=60) as anonymous:
        resp = anonymous.post("/v1/completions", json=completion())
        assert resp.status_code == 401  # 9: the key came from OCTAVO_API_KEY
    assert "from-env" not in " ".join(capped.proc.args)  # and is not on the command line

    with httpx.Client(base_url=capped.url, headers=capped.headers(), timeout=60) as http:
        # 1: requests refused after the front end has seen them leave nothing behind: the
        # waiting cap of 2 would be full for good if they did.
        for _ in range(3):
            assert_400(post_escaped(http, "/v1/completions", completion(stop=["\ud800"])), "stop")
            assert_400(http.post("/v1/completions", json=completion(top_k=10**30)), "top_k")
        assert_still_serving(capped, http)
        names = wait_idle(capped)  # --vllm-metric-names: every series twice
        assert names["vllm:generation_tokens_total"] == names["octavo:generation_tokens_total"] > 0
        assert "vllm:request_queue_time_seconds_count" in names

        # 7: a request still running when the shutdown timeout (0 s) ends, and one queued
        # behind it (max_num_seqs 1), each get an OpenAI error object.
        long_body = completion(prompt=[5], max_tokens=4000, temperature=0, ignore_eos=True)
        results: dict[str, object] = {}

        def queued() -> None:
            results["queued"] = http.post("/v1/completions", json=long_body)

        streamed: list[str] = []
        with http.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as stream:
            lines = stream.iter_lines()
            streamed.append(next(line for line in lines if line.startswith("data: {")))
            thread = threading.Thread(target=queued)
            thread.start()
            deadline = time.monotonic() + 20
            while wait_idle(capped, 0)["octavo:num_requests_waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            capped.proc.send_signal(signal.SIGTERM)
            streamed.extend(line for line in lines if line)
        thread.join(30)
    resp = results["queued"]
    assert resp.status_code == 503, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["error"]["code"] == "server_shutting_down"
    error_events = [json.loads(line[6:]) for line in streamed if '"error"' in line]
    assert error_events and error_events[0]["error"]["code"] == "server_shutting_down"
    assert streamed[-1] == "data: [DONE]"
    assert capped.wait_exit(60) == 0
    assert "Traceback" not in capped.read_log()


# ---- a busy port, /docs with no internet ---------------------------------------------------


def test_a_busy_port_is_one_line_before_the_model_loads(tiny_model, server) -> None:
    import subprocess
    import sys

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "serve", str(tiny_model), "--port",
         str(server.port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("octavo serve: error: port ")
    assert "already in use" in lines[-1] and "--port" in lines[-1]
    assert "loaded" not in done.stderr  # nothing was loaded
    assert time.monotonic() - started < 60


def test_docs_page_needs_no_internet(server, http) -> None:
    page = http.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "/docs/assets/swagger-ui-bundle.js" in page.text
    script = http.get("/docs/assets/swagger-ui-bundle.js")
    assert script.status_code == 200 and len(script.content) > 100_000
    assert http.get("/docs/assets/swagger-ui.css").status_code == 200
    assert http.get("/openapi.json").json()["info"]["title"] == "Octavo"
