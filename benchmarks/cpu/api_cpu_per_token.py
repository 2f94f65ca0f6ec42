"""CPU time of the API server process(es) per output token, the figure docs/benchmarks.md
("Serving over HTTP vs in-process") tracks for the HTTP path.

Starts ``octavo serve`` (the tiny test Llama unless ``--model``), drives it with ``octavo bench
serve`` (streamed /v1/completions, all requests at once, EOS ignored), and reads the API
processes' user + system time from /proc before and after each run (a warm-up run first, not
counted). The engine core's CPU per token is printed beside it. On a shared machine wall-clock
figures swing; CPU per token holds still much better.

    python benchmarks/cpu/api_cpu_per_token.py --runs 2
    python benchmarks/cpu/api_cpu_per_token.py --api-server-count 2 --runs 2
    python benchmarks/cpu/api_cpu_per_token.py --serve-env OCTAVO_X=1   # an A/B switch
    python benchmarks/cpu/api_cpu_per_token.py --api chat   # streamed /v1/chat/completions

``--api chat`` drives /v1/chat/completions with a small client of its own (``octavo bench
serve`` speaks completions only): all requests at once, streamed, one short user message each,
EOS ignored; the tokens are counted from the final usage chunk.

``tokens_per_event``: output tokens per streamed SSE event with text. When the API process
lags the engine core a request's pending outputs merge (``RequestOutputCollector``), one event
carrying several steps' tokens, and the per-event costs (the write, the task's wake-up) are
shared by more tokens; how much depends on how busy the machine is, so read the CPU per token
beside it. The client counts them (``bench serve``'s ``total_chunks``).

To compare two trees with the same client, give the server the other one's path:
``--serve-env PYTHONPATH=/path/to/other/core/src:/path/to/other/backends/cpu/src``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# `octavo serve` options of these runs: the tiny model's KV pool and batch sized for 256 streams.
DEFAULT_SERVE_ARGS = "--dtype float32 --num-gpu-blocks-override 4096 --max-num-seqs 256"


def model_or_tiny(model: str | None) -> str:
    """``model``, or a tiny random Llama made in a temporary folder when None."""
    if model is not None:
        return model
    from octavo.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(Path(tempfile.mkdtemp(prefix="octavo-tiny-")), "llama"))


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    sys.exit("the server did not become healthy")


def process_pids(server_pid: int, count: int, log: Path) -> tuple[list[int], int]:
    """(API process pids, engine core pid), from the supervisor's log line with N > 1."""
    if count == 1:
        children = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        spawned = b"spawn_main" in f.read()
                except OSError:
                    continue
                if ppid == server_pid and spawned:
                    children.append(int(entry))
        return [server_pid], min(children)
    match = re.search(r"API server processes \(pids ([\d, ]+)\) in front of engine core pid (\d+)",
                      log.read_text())
    assert match, "the supervisor's log has no pid line"
    return [int(p) for p in match.group(1).split(",")], int(match.group(2))


def bench(port: int, model: str, num_prompts: int, input_len: int, output_len: int,
          seed: int, client_procs: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "bench", "serve", "--port", str(port),
         "--model", model, "--num-prompts", str(num_prompts), "--input-len", str(input_len),
         "--output-len", str(output_len), "--ignore-eos", "--seed", str(seed),
         "--disable-tqdm", "--num-client-processes", str(client_procs)],
        capture_output=True, text=True, check=True)
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def bench_chat(port: int, num_prompts: int, output_len: int, seed: int) -> dict:
    """``num_prompts`` streamed chat requests at once; output tokens and throughput."""
    import asyncio

    import httpx

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"messages": [{"role": "user", "content": f"Tell me about {seed}-{i}."}],
                "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"') and '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                elif '"delta":{"content":' in line:
                    events[0] += 1
        return tokens

    events = [0]  # streamed events with text

    async def run() -> dict:
        limits = httpx.Limits(max_connections=num_prompts)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                     limits=limits) as client:
            start = time.monotonic()
            counts = await asyncio.gather(*(one(client, i) for i in range(num_prompts)))
            wall = time.monotonic() - start
        return {"total_output_tokens": sum(counts), "completed": len(counts),
                "output_throughput": sum(counts) / wall, "num_events": events[0]}

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: a tiny Llama)")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--api", choices=("completions", "chat"), default="completions")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-client-processes", type=int, default=1)
    parser.add_argument("--serve-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment of the server (A/B switches)")
    parser.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS,
                        help="extra `octavo serve` options")
    args = parser.parse_args()
    model = model_or_tiny(args.model)
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="octavo-serve-bench-", suffix=".log")[1])
    env = {**os.environ, **dict(item.split("=", 1) for item in args.serve_env)}
    with open(log, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "octavo.cli.main", "serve", model, "--port", str(port),
             *(["--api-server-count", str(args.api_server_count)]
               if args.api_server_count != 1 else []),  # older servers lack the flag
             *args.serve_args.split()],
            stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(server, port, log)
        api_pids, core_pid = process_pids(server.pid, args.api_server_count, log)
        bench(port, model, 32, args.input_len, 32, 1, 1)  # warm-up
        for run in range(args.runs):
            api0, core0 = cpu_seconds(api_pids), cpu_seconds([core_pid])
            start = time.monotonic()
            if args.api == "chat":
                result = bench_chat(port, args.num_prompts, args.output_len, run)
            else:
                result = bench(port, model, args.num_prompts, args.input_len, args.output_len,
                               run, args.num_client_processes)
            wall = time.monotonic() - start
            api, core = cpu_seconds(api_pids) - api0, cpu_seconds([core_pid]) - core0
            tokens = result["total_output_tokens"]
            events = result.get("num_events", result.get("total_chunks"))
            print(json.dumps({
                "api": args.api, "api_server_count": args.api_server_count, "run": run,
                "output_tokens": tokens, "completed": result["completed"],
                "api_cpu_us_per_token": round(1e6 * api / tokens, 1),
                "core_cpu_us_per_token": round(1e6 * core / tokens, 1),
                "output_throughput": round(result["output_throughput"], 1),
                "tokens_per_event": round(tokens / events, 2) if events else None,
                "load": f"{os.getloadavg()[0]:.2f}",
                "wall_s": round(wall, 2), "serve_env": args.serve_env,
            }), flush=True)
    finally:
        server.terminate()
        code = server.wait(120)
        if code != 0:
            print(f"server exited with {code}; log: {log}", file=sys.stderr)
        else:
            log.unlink()


if __name__ == "__main__":
    main()
