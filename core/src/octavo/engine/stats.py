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
    # Seconds from arrival to the end, per finished request.
    e2e_latencies: list[float] = field(default_factory=list)
    # finish_reason of each completion that finished ("stop", "length", "abort").
    finish_reasons: list[str] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives a snapshot after every engine-core step (e.g. Prometheus metrics)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
