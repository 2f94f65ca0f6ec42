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


def spec_decode_summary(stats: SchedulerStats, since: SchedulerStats | None = None) -> str | None:
    """One line on speculative decoding (since start, or the change since ``since``):
    mean acceptance length (tokens emitted per verifying step, the target's own included),
    draft acceptance rate and acceptance rate per draft position; None when no draft was
    verified."""
    num_drafts = stats.spec_decode_num_drafts
    num_draft_tokens = stats.spec_decode_num_draft_tokens
    num_accepted = stats.spec_decode_num_accepted_tokens
    per_pos = list(stats.spec_decode_num_accepted_tokens_per_pos)
    if since is not None:
        num_drafts -= since.spec_decode_num_drafts
        num_draft_tokens -= since.spec_decode_num_draft_tokens
        num_accepted -= since.spec_decode_num_accepted_tokens
        for i, old in enumerate(since.spec_decode_num_accepted_tokens_per_pos):
            per_pos[i] -= old
    if num_drafts <= 0:
        return None
    per_position = ", ".join(f"{n / num_drafts:.3f}" for n in per_pos)
    return (f"speculative decoding: mean acceptance length {1 + num_accepted / num_drafts:.2f}, "
            f"draft acceptance rate {num_accepted / max(num_draft_tokens, 1):.1%}, "
            f"per-position acceptance rate {per_position} (drafts {num_drafts}, draft tokens "
            f"{num_draft_tokens}, accepted {num_accepted})")


class SpecDecodeLogger:
    """A ``StatLogger`` that logs ``spec_decode_summary`` of the last ``interval_s`` seconds
    at most once per interval (the server adds it when speculation is on)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        import time

        self._clock = time.monotonic
        self.interval_s = interval_s
        self._last_time = self._clock()
        self._last: SchedulerStats | None = None

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        now = self._clock()
        if now - self._last_time < self.interval_s:
            return
        line = spec_decode_summary(scheduler_stats, self._last)
        if line is not None:
            import logging

            logging.getLogger(__name__).info("%s", line)
        self._last_time = now
        self._last = scheduler_stats
