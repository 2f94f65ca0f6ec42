"""``octavo bench serve --num-client-processes N``: the client split over N processes.

One Python process parsing every streamed chunk tops out at some tens of thousands of chunks
per second (one core: aiohttp, JSON, the event loop), below what a fast server can send. The
requests are then dealt round robin to N worker processes, each with its own event loop and HTTP client,
which send them at the same absolute arrival times (``time.perf_counter`` is the system's
monotonic clock on Linux and macOS, shared by every process of the host). Each worker writes
its results as JSON to a file the parent reads back (nothing is unpickled); a shared counter
drives the parent's progress bar.

``--max-concurrency`` is divided between the workers (each gets its share, the first ones one
more when it does not divide), so the total in flight never exceeds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from octavo.benchmarks.serve_client import (
    BenchServeError,
    RunResult,
    ServeRequest,
    Target,
    make_client,
    run_requests,
)
from octavo.benchmarks.serve_metrics import RequestResult

# How long the workers may take to start (spawn, imports) before the run is abandoned.
_START_TIMEOUT_S = 120.0


def concurrency_shares(max_concurrency: int | None, num_processes: int) -> list[int | None]:
    """Each worker's share of ``max_concurrency`` (None: unlimited for all)."""
    if max_concurrency is None:
        return [None] * num_processes
    if max_concurrency < num_processes:
        raise ValueError(f"--max-concurrency {max_concurrency} is less than "
                         f"--num-client-processes {num_processes}: each process needs one")
    base, extra = divmod(max_concurrency, num_processes)
    return [base + (1 if i < extra else 0) for i in range(num_processes)]


def _worker(index: int, target: dict[str, Any], requests: list[tuple[list[int], int]],
            send_times: list[float], max_concurrency: int | None, out_path: str,
            ready: Any, go: Any, start_at: Any, done_count: Any) -> None:
    """One worker process: wait for the common start, send its share, write its results."""
    ready.release()
    go.wait()
    serve_requests = [ServeRequest(ids, n) for ids, n in requests]

    def on_done(_: RequestResult) -> None:
        with done_count.get_lock():
            done_count.value += 1

    async def run() -> RunResult:
        async with make_client() as client:
            delay = start_at.value - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await run_requests(client, Target(**target), serve_requests, send_times,
                                      max_concurrency, on_done)

    result = asyncio.run(run())
    payload = {"index": index, "duration_s": result.duration_s,
               "max_in_flight": result.max_in_flight, "client_cpu_s": result.client_cpu_s,
               "results": [dataclasses.asdict(r) for r in result.results]}
    Path(out_path).write_text(json.dumps(payload))


def run_in_processes(target: Target, requests: list[ServeRequest], send_times: list[float],
                     max_concurrency: int | None, num_processes: int,
                     on_progress: Callable[[int], None] | None = None) -> RunResult:
    """``run_requests`` over ``num_processes`` worker processes; results in dataset order.

    ``max_in_flight`` is the sum of the workers' peaks (an upper bound of the true peak).
    :param on_progress: called with the number of requests finished so far, a few times a
        second.
    :raises BenchServeError: a worker failed or did not start.
    """
    if num_processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {num_processes}")
    shares = concurrency_shares(max_concurrency, num_processes)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0)
    done_count = ctx.Value("i", 0)
    target_dict = dataclasses.asdict(target)
    with tempfile.TemporaryDirectory(prefix="octavo-bench-serve-") as folder:
        processes, paths, parts = [], [], []
        for index in range(num_processes):
            part = list(range(index, len(requests), num_processes))
            parts.append(part)
            paths.append(os.path.join(folder, f"worker-{index}.json"))
            process = ctx.Process(
                target=_worker, name=f"octavo-bench-client-{index}", daemon=True,
                args=(index, target_dict,
                      [(requests[i].prompt_token_ids, requests[i].output_len) for i in part],
                      [send_times[i] for i in part], shares[index], paths[index],
                      ready, go, start_at, done_count))
            process.start()
            processes.append(process)
        try:
            for _ in processes:
                if not ready.acquire(timeout=_START_TIMEOUT_S):
                    raise BenchServeError(f"the client processes did not start within "
                                          f"{_START_TIMEOUT_S:.0f} s")
            start_at.value = time.perf_counter() + 0.2  # every worker is waiting on go
            go.set()
            while any(p.is_alive() for p in processes):
                if on_progress is not None:
                    on_progress(done_count.value)
                time.sleep(0.2)
            if on_progress is not None:
                on_progress(done_count.value)
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
                process.join()
        failed = [p.name for p in processes if p.exitcode != 0]
        if failed:
            raise BenchServeError(f"client process(es) {', '.join(failed)} failed (exit codes "
                                  f"{[p.exitcode for p in processes]}); see their errors above")
        payloads = [json.loads(Path(path).read_text()) for path in paths]
    results: list[RequestResult | None] = [None] * len(requests)
    for part, payload in zip(parts, payloads, strict=True):
        for i, record in zip(part, payload["results"], strict=True):
            results[i] = RequestResult(**record)
    end = max(start_at.value + p["duration_s"] for p in payloads)
    return RunResult([r for r in results if r is not None], end - start_at.value,
                     sum(p["max_in_flight"] for p in payloads),
                     tuple(cpu for p in payloads for cpu in p["client_cpu_s"]))
