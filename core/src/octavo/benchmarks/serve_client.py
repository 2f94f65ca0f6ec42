"""The client side of ``octavo bench serve``: a random dataset, arrival times, and an async
driver that streams ``/v1/completions`` requests from an OpenAI-compatible server.

Prompts are sent as **token-id lists** (``"prompt": [id, ...]``, which the OpenAI completions
API allows): the server sees exactly ``input_len`` tokens (decoded text would re-tokenize to
another count), the client needs no tokenizer round trip, and the token ids are the same ones
``octavo bench throughput --async-engine`` feeds ``AsyncLLM`` for the same seed and lengths, so
the two figures are of the same requests.

Arrival times: ``request_rate`` requests per second with gaps drawn from a gamma distribution
of shape ``burstiness`` (1.0: exponential gaps, a Poisson process; lower: burstier, higher:
more even) and mean ``1 / request_rate``; ``inf``: every request at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec
import numpy as np

from octavo.benchmarks.serve_metrics import RequestResult


@dataclass(slots=True)
class ServeRequest:
    """One request of the dataset."""

    # Prompt token ids.
    prompt_token_ids: list[int]
    # max_tokens asked for.
    output_len: int


@dataclass(slots=True)
class Target:
    """Where and how requests go."""

    # Full URL of the completions endpoint, e.g. http://127.0.0.1:8000/v1/completions.
    url: str
    # The "model" field.
    model: str
    # Sent as "Authorization: Bearer KEY" (None: no header).
    api_key: str | None = None
    # "ignore_eos": true in every request (vLLM's extra field; Octavo takes it).
    ignore_eos: bool = False


#: Longest streamed line the client holds while waiting for its end (a bound, not a format
#: limit: a text chunk is a few hundred bytes).
MAX_SSE_LINE_BYTES = 1 << 20


class BenchServeError(RuntimeError):
    """The benchmark cannot run (server unreachable, model refused): one line saying why."""


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """``[length * (1 - r), length * (1 + r)]`` as whole tokens, at least 1 (vLLM's meaning)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   prefix_len: int, vocab_size: int, seed: int) -> list[ServeRequest]:
    """Random token-id prompts: ``prefix_len`` ids shared by every prompt, then each prompt's
    own ids, lengths uniform in ``length_range``. With ``prefix_len`` 0 the prompts and output
    lengths are ``octavo.cli.bench.make_workload``'s for the same seed and ranges."""
    from octavo.cli.bench import make_workload

    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    workload = make_workload(num_prompts, length_range(input_len, range_ratio),
                             length_range(output_len, range_ratio), vocab_size, seed)
    prefix_rng = random.Random(f"prefix-{seed}")
    prefix = [prefix_rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [ServeRequest(prefix + prompt, n)
            for prompt, n in zip(workload.prompts, workload.output_lens)]


def arrival_times(num_requests: int, request_rate: float, burstiness: float,
                  seed: int) -> list[float]:
    """Send time of each request, in seconds after the first (which is at 0.0).

    :param request_rate: mean requests per second; ``inf``: all at 0.0.
    :param burstiness: shape of the gamma-distributed gaps (1.0: Poisson arrivals).
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    # Gamma(shape k, scale theta) has mean k * theta: theta = 1 / (rate * k) keeps the rate.
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def make_client(timeout_s: float | None = None) -> aiohttp.ClientSession:
    """One HTTP client for the whole run (aiohttp, as ``vllm bench serve``: its C parser
    reads a streamed chunk for ~25 µs of CPU where httpx took ~50-80, so one client process
    keeps up with about twice the chunks a second). No cap on connections (the benchmark's
    own ``--max-concurrency`` is the only limit), no read timeout by default (a long request
    is data, not an error). Use it as ``async with``."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0),
    )


def _payload(target: Target, request: ServeRequest, max_tokens: int | None = None) -> dict:
    payload = {
        "model": target.model,
        "prompt": request.prompt_token_ids,
        "max_tokens": max_tokens if max_tokens is not None else request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()[:200]
    return f"HTTP {status}: {message}"


async def send_request(client: aiohttp.ClientSession, target: Target,
                       request: ServeRequest) -> RequestResult:
    """Stream one completion and time every chunk (``data:`` lines split from the socket's
    reads, each read's chunks stamped with its arrival). Never raises for the server's
    answer or a lost connection: ``success`` and ``error`` say what happened."""
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    result.start_time = start = time.perf_counter()
    num_chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.post(target.url, json=_payload(target, request),
                               headers=_headers(target)) as response:
            if response.status != 200:
                result.error = _error_message(response.status, await response.read())
                result.latency = time.perf_counter() - start
                return result
            pending = b""  # the last read's unfinished line
            finished = False
            async for data in response.content.iter_any():  # whatever one read brought
                now = time.perf_counter()
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                if len(pending) > MAX_SSE_LINE_BYTES:
                    raise ValueError(f"an SSE line of more than {MAX_SSE_LINE_BYTES} bytes")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        finished = True
                        break
                    event = msgspec.json.decode(payload)
                    if "error" in event:
                        error = event["error"]
                        message = error.get("message", error) if isinstance(error, dict) else error
                        result.error = f"stream error: {message}"
                        finished = True
                        break
                    if event.get("choices"):
                        if num_chunks == 0:
                            result.ttft = now - start
                        result.chunk_times.append(now)
                        num_chunks += 1
                    usage = event.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens")
                if finished:
                    break
        result.latency = time.perf_counter() - start
        if not result.error:
            result.output_len = usage_tokens if usage_tokens is not None else num_chunks
            result.success = num_chunks > 0
            if not result.success:
                result.error = "the response streamed no completion chunk"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        # ValueError: an over-long line, or a chunk that is not JSON (msgspec.DecodeError)
        result.latency = time.perf_counter() - start
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def check_server(client: aiohttp.ClientSession, target: Target,
                       request: ServeRequest) -> None:
    """One short request before the run, so that a server that is not there, a wrong model
    name or a wrong endpoint fails the benchmark at once with one line.

    :raises BenchServeError: saying what is wrong and what to do.
    """
    probe = ServeRequest(request.prompt_token_ids, 1)
    try:
        result = await send_request(client, target, probe)
    except Exception as exc:  # noqa: BLE001 - reported in one line
        raise BenchServeError(f"the test request failed: {exc}") from None
    if result.success:
        return
    error = result.error
    if error.startswith(("ClientConnectorError", "ConnectionTimeoutError",
                         "ServerTimeoutError")):
        raise BenchServeError(
            f"cannot reach a server at {target.url} ({error.split(': ', 1)[-1]}); start one "
            "(octavo serve MODEL) or point --base-url / --host / --port at it")
    if error.startswith("HTTP 404") and "model" in error:
        raise BenchServeError(f"the server refused model {target.model!r} ({error}); pass "
                              "--model with a name it serves (GET /v1/models lists them)")
    if error.startswith("HTTP 404"):
        raise BenchServeError(f"{target.url} does not exist ({error}); check --endpoint "
                              "(/v1/completions)")
    if error.startswith("HTTP 401"):
        raise BenchServeError(f"the server wants an API key ({error}); set OPENAI_API_KEY")
    raise BenchServeError(f"the test request to {target.url} failed: {error}")


async def served_model(client: aiohttp.ClientSession, base_url: str,
                       api_key: str | None) -> str:
    """The first model ``GET /v1/models`` lists (what ``--model`` defaults to).

    :raises BenchServeError: the server cannot be reached or lists nothing.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with client.get(f"{base_url}/v1/models", headers=headers) as response:
            status, body = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchServeError(f"cannot reach a server at {base_url} ({type(exc).__name__}: "
                              f"{exc}); start one (octavo serve MODEL) or point --base-url / "
                              "--host / --port at it") from None
    if status != 200:
        raise BenchServeError(f"GET {base_url}/v1/models: {_error_message(status, body)}; "
                              "pass --model")
    try:
        models = json.loads(body).get("data") or []
    except (ValueError, AttributeError):
        raise BenchServeError(f"GET {base_url}/v1/models did not answer a JSON object; "
                              "pass --model") from None
    if not models:
        raise BenchServeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


@dataclass(slots=True)
class RunResult:
    """What ``run_requests`` returns."""

    # One per request, in dataset order.
    results: list[RequestResult]
    # From the first send to the last response's end (s).
    duration_s: float
    # Most requests in flight at once, counted live.
    max_in_flight: int
    # CPU seconds (user + system) each client process spent from its first send to its last
    # response: near ``duration_s`` means the client, not the server, set the pace.
    client_cpu_s: tuple[float, ...] = ()


async def run_requests(client: aiohttp.ClientSession, target: Target, requests: list[ServeRequest],
                       send_times: list[float], max_concurrency: int | None,
                       on_done: Callable[[RequestResult], None] | None = None) -> RunResult:
    """Send ``requests[i]`` at ``send_times[i]`` seconds (or later, while ``max_concurrency``
    requests are in flight) and wait for all of them.

    :param on_done: called with each result as it completes (a progress bar).
    """
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0

    async def one(request: ServeRequest) -> RequestResult:
        nonlocal in_flight, peak
        if semaphore is not None:
            await semaphore.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            result = await send_request(client, target, request)
        finally:
            in_flight -= 1
            if semaphore is not None:
                semaphore.release()
        if on_done is not None:
            on_done(result)
        return result

    tasks: list[asyncio.Task[RequestResult]] = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    for request, send_at in zip(requests, send_times):
        delay = start + send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    return RunResult(list(results), time.perf_counter() - start, peak,
                     (time.process_time() - cpu_start,))
