"""What ``octavo bench serve`` measures, computed from per-request timings.

Each request's client-side record is a ``RequestResult`` (when it was sent, when each streamed
chunk arrived, how many tokens came back); ``calculate_metrics`` turns a run's records into a
``ServeMetrics``. The definitions are vLLM's ``vllm bench serve`` ones, so figures compare:

- **TTFT** (time to first token): first streamed chunk minus the request's send time.
- **ITL** (inter-token latency): the gaps between successive chunks of one request, pooled over
  every request (one chunk carries one step's tokens: usually one).
- **TPOT** (time per output token): ``(E2EL - TTFT) / (output_len - 1)`` per request with more
  than one output token, averaged over requests.
- **E2EL** (end-to-end latency): the last byte of the response minus the send time.
- **Goodput**: requests per second that met every given SLO (TTFT, TPOT, E2EL in ms).
- **Peak output tok/s**: the most chunks received in any one-second window of the run
  (``PEAK_WINDOW_S``), as output tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

# Width of the windows ``peak_output_throughput`` counts chunks in.
PEAK_WINDOW_S = 1.0
# SLO names ``--goodput`` takes (vLLM's), each in milliseconds.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (times are ``time.perf_counter()`` seconds)."""

    # Prompt tokens sent.
    prompt_len: int
    # Whether a complete response came back.
    success: bool = False
    # Why not, when ``success`` is False (the server's message or the transport error).
    error: str = ""
    # Output tokens the server reported (``usage.completion_tokens``), else chunks counted.
    output_len: int = 0
    # When the request was sent.
    start_time: float = 0.0
    # Arrival time of each streamed chunk that carried a choice, in order.
    chunk_times: list[float] = field(default_factory=list)
    # Time to first token (s); 0.0 if no chunk came.
    ttft: float = 0.0
    # End-to-end latency (s).
    latency: float = 0.0

    @property
    def itl(self) -> list[float]:
        """Gaps between successive chunks (s)."""
        return [b - a for a, b in pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (s); None for a single-token output."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(slots=True)
class Distribution:
    """Summary of one latency metric over a run, in milliseconds."""

    mean: float
    median: float
    std: float
    # Percentile (as given, e.g. 99.0) -> value.
    percentiles: dict[float, float]

    @classmethod
    def of(cls, values_s: list[float], percentiles: list[float]) -> Distribution:
        """Summary of ``values_s`` (seconds; empty: all zeros)."""
        ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in percentiles})


@dataclass(slots=True)
class ServeMetrics:
    """A run's figures (counts of successful requests only)."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # Requests per second that met every SLO (None: no --goodput given).
    request_goodput: float | None
    # Most output tokens (chunks) in one PEAK_WINDOW_S window, per second.
    peak_output_throughput: float
    # Most requests in flight at once, as the client counted them.
    max_concurrent_requests: int
    # Streamed chunks that carried a choice (a server that merges steps sends fewer).
    total_chunks: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 0.2, "tpot": 0.05}`` (seconds).

    :raises ValueError: an unknown metric name or a value that is not a number > 0.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not ms > 0:
            raise ValueError(f"--goodput {name}: expected milliseconds > 0, got {value!r}")
        slos[name] = ms / 1000.0
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (a one-token request meets any TPOT)."""
    tpot = result.tpot
    return (result.ttft <= slos.get("ttft", float("inf"))
            and (tpot is None or tpot <= slos.get("tpot", float("inf")))
            and result.latency <= slos.get("e2el", float("inf")))


def peak_output_throughput(results: list[RequestResult], window_s: float = PEAK_WINDOW_S) -> float:
    """Most chunks received in any ``window_s`` window starting at a chunk, per second."""
    times = np.sort(np.asarray([t for r in results if r.success for t in r.chunk_times]))
    if times.size == 0:
        return 0.0
    # For each chunk, the chunks in [t, t + window): a sliding window over sorted times.
    ends = np.searchsorted(times, times + window_s, side="left")
    return float((ends - np.arange(times.size)).max()) / window_s


def max_in_flight(results: list[RequestResult]) -> int:
    """Most requests between their send and their end at once (from the records)."""
    events = sorted([(r.start_time, 1) for r in results]
                    + [(r.start_time + r.latency, -1) for r in results])
    # Ends sort before starts at the same instant (-1 < 1): back-to-back is not overlap.
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      slos: dict[str, float] | None = None,
                      percentiles: tuple[float, ...] = (99.0,)) -> ServeMetrics:
    """The run's figures; latencies and token counts from successful requests only.

    :param duration_s: wall time from the first request sent to the last one finished.
    :param slos: ``parse_goodput``'s output; None or empty: no goodput.
    """
    assert duration_s > 0, f"a run takes time, got duration {duration_s}"
    ok = [r for r in results if r.success]
    pct = list(percentiles)
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    goodput = (sum(meets_slos(r, slos) for r in ok) / duration_s) if slos else None
    return ServeMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        request_goodput=goodput,
        peak_output_throughput=peak_output_throughput(ok),
        max_concurrent_requests=max_in_flight(results),
        total_chunks=sum(len(r.chunk_times) for r in ok),
        ttft=Distribution.of([r.ttft for r in ok], pct),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None], pct),
        itl=Distribution.of([gap for r in ok for gap in r.itl], pct),
        e2el=Distribution.of([r.latency for r in ok], pct),
    )
