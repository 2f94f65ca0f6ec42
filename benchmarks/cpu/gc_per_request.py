"""Cyclic garbage collection in the server's processes, per request, under collector thresholds.

    python benchmarks/cpu/gc_per_request.py --thresholds 700,10,10 50000,20,100 --rounds 2

For each threshold triple in turn (``OCTAVO_GC_THRESHOLD``, which the server's processes
apply once started; a ``sitecustomize`` module on ``PYTHONPATH`` times every collection with
``gc.callbacks``): ``octavo serve`` on the tiny test Llama (or ``--model``), a warm-up, then
``octavo bench serve`` with ``--num-prompts`` streamed requests at once. Prints, per process (the API server, the engine core), the collections of each
generation and their seconds during the run, and the process's CPU, all per request; then
one JSON line per run. CPU time is what holds still on a shared machine; GC seconds are wall
time inside the collector (the process is on the CPU for all of it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_cpu_per_token import (
    DEFAULT_SERVE_ARGS,
    cpu_seconds,
    free_port,
    model_or_tiny,
    process_pids,
    wait_healthy,
)

_SITECUSTOMIZE = '''
import gc, json, os, signal, time
_start = [0.0]
_stats = {{0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}}

def _timed(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        entry = _stats[info["generation"]]
        entry[0] += 1
        entry[1] += time.perf_counter() - _start[0]

def _dump(*_):
    with open(os.path.join({folder!r}, f"gc-{{os.getpid()}}.json"), "w") as f:
        json.dump({{str(g): v for g, v in _stats.items()}}, f)

gc.callbacks.append(_timed)
signal.signal(signal.SIGUSR1, _dump)
'''


def _gc_stats(folder: Path, pids: list[int]) -> dict[int, dict[int, list[float]]]:
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    stats = {}
    for pid in pids:
        path = folder / f"gc-{pid}.json"
        while True:
            try:
                stats[pid] = {int(g): v for g, v in json.loads(path.read_text()).items()}
                path.unlink()
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = f.read().replace(b"\0", b" ").decode()
                    sys.exit(f"process {pid} ({command}) wrote no GC figures")
                time.sleep(0.05)
    return stats


def _bench(port: int, model: str, num_prompts: int, input_len: int, output_len: int,
           seed: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "octavo.cli.main", "bench", "serve", "--port", str(port),
         "--model", model, "--num-prompts", str(num_prompts), "--input-len", str(input_len),
         "--output-len", str(output_len), "--ignore-eos", "--seed", str(seed),
         "--disable-tqdm"], check=True, capture_output=True, text=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def one_run(threshold: str, model: str, args: argparse.Namespace, run: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="octavo-gc-"))
    (folder / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(folder=str(folder)))
    env = {**os.environ, "OCTAVO_GC_THRESHOLD": threshold}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    port = free_port()
    log = folder / "server.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "octavo.cli.main", "serve", model, "--port", str(port),
             *args.serve_args.split()], stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(server, port, log)
        api_pids, core_pid = process_pids(server.pid, 1, log)
        pids = [*api_pids, core_pid]
        _bench(port, model, 32, args.input_len, args.output_len, seed=1)  # warm-up
        gc_before, cpu_before = _gc_stats(folder, pids), [cpu_seconds([p]) for p in pids]
        result = _bench(port, model, args.num_prompts, args.input_len, args.output_len, seed=0)
        gc_after, cpu_after = _gc_stats(folder, pids), [cpu_seconds([p]) for p in pids]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    per_request = 1e6 / result["completed"]
    record = {"threshold": threshold, "run": run, "completed": result["completed"],
              "output_throughput": result["output_throughput"], "load": os.getloadavg()[0]}
    for name, pid, before, after in zip(("api", "core"), pids, cpu_before, cpu_after,
                                        strict=True):
        gc_us = sum(gc_after[pid][g][1] - gc_before[pid][g][1] for g in range(3)) * per_request
        counts = [int(gc_after[pid][g][0] - gc_before[pid][g][0]) for g in range(3)]
        record[f"{name}_cpu_us_per_request"] = round((after - before) * per_request, 1)
        record[f"{name}_gc_us_per_request"] = round(gc_us, 1)
        record[f"{name}_collections"] = counts
        print(f"{threshold:>16} run {run} {name:>4}: CPU {record[f'{name}_cpu_us_per_request']:8.1f}"
              f" us/request, of it GC {gc_us:7.1f} us ({counts[0]} / {counts[1]} / {counts[2]} "
              "collections of generation 0 / 1 / 2)", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thresholds", nargs="+", default=["700,10,10", "50000,20,100"],
                        help="gc.set_threshold triples, run in turns")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="model folder (default: a tiny Llama)")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=2)
    parser.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS,
                        help="extra `octavo serve` options")
    args = parser.parse_args()
    model = model_or_tiny(args.model)
    records = [one_run(threshold, model, args, run)
               for run in range(args.rounds) for threshold in args.thresholds]
    for record in records:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
