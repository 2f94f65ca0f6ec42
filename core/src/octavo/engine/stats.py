"""Front-end statistics of one engine step, and the protocol of whoever consumes them.

``OutputProcessor`` fills an ``IterationStats`` while it turns a step's outputs into
``RequestOutput``s; ``AsyncLLM`` hands it, with the engine core's ``SchedulerStats``, to
every ``StatLogger`` (e.g. the server's Prometheus metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from octavo.messages import SchedulerStats


@dataclass(slots=True)
class IterationStats:
    """What happened in the front end since the previous engine-core message."""

    # Prompt tokens of requests admitted since then.
    num_prompt_tokens: int = 0
    # Tokens generated in this step.
    num_generation_tokens: int = 0
    # Seconds from arrival to the first token, per completion that got its first token.
    time_to_first_tokens: list[float] = field(default_factory=list)
    # Seconds between a completion's previous token and this one.
    inter_token_latencies: list[float] = field(default_factory=list)
    # finish_reason of each completion that finished ("stop", "length", "abort").
    finish_reasons: list[str] = field(default_factory=list)
    # One per request that finished in this step (aborted ones excluded).
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class FinishedRequestStats:
    """The timings and sizes of one finished request (seconds; time.time() differences)."""

    # Arrival to the end.
    e2e_latency: float
    # Arrival to its first scheduling (waiting in the queue).
    queue_time: float
    # First scheduling to the first token (the prompt's prefill, chunks and all).
    prefill_time: float
    # First token to the end.
    decode_time: float
    # First scheduling to the end.
    inference_time: float
    # Decode time per generated token after the first (None with a single token).
    time_per_output_token: float | None
    # Prompt tokens, and tokens generated over all its completions.
    num_prompt_tokens: int
    num_generation_tokens: int
    # Its n and max_tokens (None: up to max_model_len).
    n: int
    max_tokens: int | None


class StatLogger(Protocol):
    """Receives a snapshot after every engine-core step (e.g. Prometheus metrics)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
