"""``octavo bench serve``'s driver against a stand-in SSE server on 127.0.0.1 that records
when each request arrived and how many were in flight: the arrival rate and
``--max-concurrency`` are what the server saw, not what the client believes."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from octavo.benchmarks.serve_client import (
    BenchServeError,
    ServeRequest,
    Target,
    arrival_times,
    check_server,
    make_client,
    run_requests,
)

CHUNK_GAP_S = 0.01


class StandInServer:
    """Answers every POST with ``max_tokens`` SSE chunks ``CHUNK_GAP_S`` apart, then usage."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0,
                                                 backlog=1024)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break  # the client closed its kept-alive connection
            self.arrivals.append(time.perf_counter())
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            events = [{"choices": [{"index": 0, "text": "x"}]}] * body["max_tokens"]
            events.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            for event in events:
                await asyncio.sleep(CHUNK_GAP_S)
                self._chunk(writer, f"data: {json.dumps(event)}\n\n".encode())
                await writer.drain()
            self._chunk(writer, b"data: [DONE]\n\n")
            self._chunk(writer, b"")
            await writer.drain()
            self.in_flight -= 1
        writer.close()

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def _requests(num: int, output_len: int) -> list[ServeRequest]:
    return [ServeRequest([1, 2, 3], output_len) for _ in range(num)]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_max_concurrency_is_what_the_server_sees():
    async def main():
        server = StandInServer()
        url = await server.start()
        async with make_client() as client:
            run = await run_requests(client, Target(f"{url}/v1/completions", "m"),
                                     _requests(24, 5), [0.0] * 24, max_concurrency=4)
        await server.stop()
        return server, run

    server, run = _run(main())
    assert server.max_in_flight == 4 and run.max_in_flight == 4
    assert len(server.arrivals) == 24
    assert all(r.success and r.output_len == 5 and len(r.chunk_times) == 5 for r in run.results)
    for r in run.results:
        assert r.latency >= r.ttft >= CHUNK_GAP_S


def test_no_limit_sends_every_request_at_once():
    async def main():
        server = StandInServer()
        url = await server.start()
        async with make_client() as client:  # no connection cap: all 150 open together
            run = await run_requests(client, Target(f"{url}/v1/completions", "m"),
                                     _requests(150, 20), [0.0] * 150, max_concurrency=None)
        await server.stop()
        return server, run

    server, run = _run(main())
    assert server.max_in_flight == 150 == run.max_in_flight


def test_requests_arrive_at_the_requested_rate():
    rate = 40.0
    send_times = arrival_times(40, rate, 1.0, seed=0)

    async def main():
        server = StandInServer()
        url = await server.start()
        async with make_client() as client:
            await run_requests(client, Target(f"{url}/v1/completions", "m"), _requests(1, 1),
                               [0.0], None)  # connection warm-up, untimed
            server.arrivals.clear()
            await run_requests(client, Target(f"{url}/v1/completions", "m"),
                               _requests(40, 2), send_times, max_concurrency=None)
        await server.stop()
        return server

    server = _run(main())
    seen = np.asarray(server.arrivals) - server.arrivals[0]
    # Each request reached the server when planned: never early, late only by the event
    # loop's scheduling (loose bounds: CI's two cores are shared), and lateness does not add up.
    lateness = seen - np.asarray(send_times)
    assert lateness.min() > -0.005 and np.median(lateness) < 0.05, lateness
    assert seen[-1] == pytest.approx(send_times[-1], abs=0.25)


def test_an_unreachable_server_is_one_clear_error():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # the port is now closed
        async with make_client() as client:
            await check_server(client, Target(f"http://127.0.0.1:{port}/v1/completions", "m"),
                               ServeRequest([1], 4))

    with pytest.raises(BenchServeError, match=r"cannot reach a server at .*--port"):
        _run(main())


class RawStreamServer:
    """Answers every POST with ``body`` (an SSE stream), written ``piece`` bytes at a time with
    a pause between writes, so lines and events are cut across the client's reads."""

    def __init__(self, body: bytes, piece: int) -> None:
        self.body, self.piece = body, piece
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(self.body), self.piece):
            StandInServer._chunk(writer, self.body[i:i + self.piece])
            await writer.drain()
            await asyncio.sleep(0.001)
        StandInServer._chunk(writer, b"")
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def _stream_once(body: bytes, piece: int):
    async def main():
        server = RawStreamServer(body, piece)
        url = await server.start()
        async with make_client() as client:
            run = await run_requests(client, Target(url, "m"), _requests(1, 5), [0.0], None)
        await server.stop()
        return run

    return _run(main())


def _events(*events: dict, newline: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + newline + newline for e in events)


@pytest.mark.parametrize("piece", [1, 7, 10_000], ids=lambda p: f"{p}-byte-writes")
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_chunks_cut_anywhere_across_reads_are_each_counted_once(piece, newline):
    chunk = {"choices": [{"index": 0, "text": "x"}]}
    body = (b": a comment line\n\n" + _events(*[chunk] * 5, newline=newline)
            + _events({"choices": [], "usage": {"completion_tokens": 5}}, newline=newline)
            + b"data: [DONE]" + newline + newline)
    run = _stream_once(body, piece)
    (result,) = run.results
    assert result.success, result.error
    assert result.output_len == 5 and len(result.chunk_times) == 5
    assert result.chunk_times == sorted(result.chunk_times)
    assert 0 < result.ttft <= result.latency
    # One client process: its CPU over the run, at most the run's wall time (and a margin
    # for the clock's granularity).
    (cpu,) = run.client_cpu_s
    assert 0 < cpu <= run.duration_s + 0.05


def test_an_error_event_in_the_stream_fails_the_request_with_its_message():
    body = (_events({"choices": [{"index": 0, "text": "x"}]})
            + _events({"error": {"message": "the engine is gone", "type": "server_error"}}))
    (result,) = _stream_once(body, 10_000).results
    assert not result.success and result.error == "stream error: the engine is gone"


def test_a_line_without_end_is_an_error_not_unbounded_memory(monkeypatch):
    from octavo.benchmarks import serve_client

    monkeypatch.setattr(serve_client, "MAX_SSE_LINE_BYTES", 4096)
    body = b"data: " + b"x" * 20_000
    (result,) = _stream_once(body, 1000).results
    assert not result.success and "SSE line of more than 4096 bytes" in result.error


def test_a_chunk_that_is_not_json_fails_the_request():
    (result,) = _stream_once(b"data: {not json\n\n", 10_000).results
    assert not result.success and result.error.startswith("DecodeError")
