"""How fast this host runs the engine thread's kind of work right now: one pure-Python loop of
5 million additions, timed once (lower is faster). The device machine's host varied by up to
2x in this between minutes of one lease (docs/benchmarks.md, fifteenth structured-outputs
round), and host-bound runs (a constrained W1) move with it; printing it before each run lets
a reader tell a slow host from a slow change."""

from __future__ import annotations

import time

ADDITIONS = 5_000_000


def probe_ms() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(ADDITIONS):
        total += i
    return 1e3 * (time.perf_counter() - start)


if __name__ == "__main__":
    print(f"host probe: {probe_ms():.0f} ms for {ADDITIONS // 1_000_000}M Python additions")
