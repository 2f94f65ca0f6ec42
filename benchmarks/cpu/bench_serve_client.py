"""``octavo bench serve``'s own cost: the client's CPU per streamed chunk, alone.

    python benchmarks/cpu/bench_serve_client.py                     # one chunk per write
    python benchmarks/cpu/bench_serve_client.py --chunks-per-write 4

A stand-in server in another process answers every completion request with ``--output-len``
SSE chunks shaped like Octavo's streamed completion chunks, as fast as its event loop can
write them (``--chunks-per-write`` of them per write, as when a lagging API process merges
nothing but a socket read still carries several); ``octavo.benchmarks.serve_client``'s real
``run_requests`` streams ``--num-requests`` of them at once. The figure is the client
process's CPU per chunk (timed around the run here, as ``RunResult.client_cpu_s`` counts it,
so that an older client can be timed too): what bounds the chunks a second one client
process can take in, so how many ``--num-client-processes`` a server's rate needs. Prints
one line per repeat and a JSON line with the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_cpu_per_token import free_port

# What the stand-in writes per chunk: an Octavo text-only completion chunk.
_CHUNK = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
          b'"created":1764650000,"model":"m","choices":[{"index":0,"text":" word",'
          b'"logprobs":null,"finish_reason":null}]}\n\n')

_SERVER = r'''
import asyncio, json, sys
CHUNK, PER_WRITE = bytes.fromhex(sys.argv[2]), int(sys.argv[3])

def framed(data):
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"

async def handle(reader, writer):
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            break
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        n = json.loads(await reader.readexactly(length))["max_tokens"]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(0, n, PER_WRITE):
            writer.write(framed(CHUNK * min(PER_WRITE, n - i)))
            await writer.drain()
            await asyncio.sleep(0)  # let the other streams write too
        usage = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % n
        writer.write(framed(usage) + framed(b"data: [DONE]\n\n") + framed(b""))
        await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''


def _wait_listening(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit("the stand-in server exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit("the stand-in server did not listen within 30 s")


async def _one_run(port: int, num_requests: int, output_len: int) -> tuple[float, int, float]:
    from octavo.benchmarks.serve_client import ServeRequest, Target, make_client, run_requests

    target = Target(f"http://127.0.0.1:{port}/v1/completions", "m")
    async with make_client() as client:
        await run_requests(client, target, [ServeRequest([1] * 8, 4)], [0.0], None)  # connect
        cpu_start = time.process_time()
        run = await run_requests(client, target,
                                 [ServeRequest([1] * 512, output_len)] * num_requests,
                                 [0.0] * num_requests, None)
        cpu = time.process_time() - cpu_start
    failed = [r.error for r in run.results if not r.success]
    if failed:
        sys.exit(f"{len(failed)} requests failed; first: {failed[0]}")
    chunks = sum(len(r.chunk_times) for r in run.results)
    return cpu, chunks, run.duration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=125,
                        help="streams at once (bench-serve's 500 over 4 client processes: 125)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunks-per-write", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), _CHUNK.hex(),
                               str(args.chunks_per_write)])
    try:
        _wait_listening(port, server)
        per_chunk = []
        for repeat in range(args.repeats):
            cpu, chunks, wall = asyncio.run(_one_run(port, args.num_requests, args.output_len))
            per_chunk.append(1e6 * cpu / chunks)
            print(f"run {repeat + 1}: {chunks} chunks in {wall:.2f} s, client CPU {cpu:.2f} s "
                  f"= {per_chunk[-1]:.1f} us per chunk ({chunks / cpu:,.0f} chunks per CPU "
                  "second)")
    finally:
        server.terminate()
        server.wait()
    print(json.dumps({"bench": "serve_client", "num_requests": args.num_requests,
                      "output_len": args.output_len, "chunks_per_write": args.chunks_per_write,
                      "median_client_cpu_us_per_chunk": round(statistics.median(per_chunk), 2)}))


if __name__ == "__main__":
    main()
