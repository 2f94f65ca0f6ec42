"""Prometheus metrics of the server (``GET /metrics``), all named under ``octavo:``.

``PrometheusStatLogger`` is an ``AsyncLLM`` stat logger: it is called after every engine-core
step with the scheduler's snapshot and what the front end saw in that step. Metrics live in
their own ``CollectorRegistry`` (never the global one), labelled with the served model name.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from octavo.engine.stats import IterationStats
from octavo.messages import SchedulerStats

# Counters expose only ``*_total`` (no ``*_created`` series).
prometheus_client.disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0)

# (name, kind, help) of every metric, for the docs and the tests.
METRICS = (
    ("octavo:num_requests_running", "gauge", "Requests in the engine's running batch."),
    ("octavo:num_requests_waiting", "gauge", "Requests waiting to run (new or preempted)."),
    ("octavo:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks held by requests (0 to 1)."),
    ("octavo:prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens looked up, since start."),
    ("octavo:num_preemptions", "counter", "Requests preempted to free KV blocks (recomputed later)."),
    ("octavo:prompt_tokens", "counter", "Prompt tokens of admitted requests."),
    ("octavo:generation_tokens", "counter", "Generated tokens."),
    ("octavo:request_success", "counter", "Finished completions, by finished_reason (stop, length, abort)."),
    ("octavo:time_to_first_token_seconds", "histogram", "Seconds from arrival to the first generated token."),
    ("octavo:inter_token_latency_seconds", "histogram", "Seconds between two tokens of one completion."),
    ("octavo:e2e_request_latency_seconds", "histogram", "Seconds from arrival to the end of a request."),
)


class PrometheusStatLogger:
    """Turns engine snapshots into Prometheus metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        doc = {name: text for name, _, text in METRICS}
        r = self.registry

        def gauge(name: str) -> Gauge:
            return Gauge(name, doc[name], labels, registry=r).labels(model_name)

        def counter(name: str) -> Counter:
            return Counter(name, doc[name], labels, registry=r).labels(model_name)

        def histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc[name], labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("octavo:num_requests_running")
        self.num_waiting = gauge("octavo:num_requests_waiting")
        self.kv_cache_usage = gauge("octavo:kv_cache_usage_perc")
        self.prefix_cache_hit_rate = gauge("octavo:prefix_cache_hit_rate")
        self.num_preemptions = counter("octavo:num_preemptions")
        self.prompt_tokens = counter("octavo:prompt_tokens")
        self.generation_tokens = counter("octavo:generation_tokens")
        self._request_success = Counter(
            "octavo:request_success", doc["octavo:request_success"], ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)  # exported as 0 from the start
        self.time_to_first_token = histogram("octavo:time_to_first_token_seconds", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("octavo:inter_token_latency_seconds", _LATENCY_BUCKETS)
        self.e2e_latency = histogram("octavo:e2e_request_latency_seconds", _E2E_BUCKETS)
        self._last_num_preemptions = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.num_running.set(scheduler_stats.num_running)
        self.num_waiting.set(scheduler_stats.num_waiting)
        self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
        self.prefix_cache_hit_rate.set(scheduler_stats.prefix_cache_hit_rate)
        new_preemptions = scheduler_stats.num_preemptions - self._last_num_preemptions
        if new_preemptions > 0:
            self.num_preemptions.inc(new_preemptions)
        self._last_num_preemptions = scheduler_stats.num_preemptions
        if iteration_stats.num_prompt_tokens:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_generation_tokens:
            self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for value in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(value)
        for value in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(value)
        for value in iteration_stats.e2e_latencies:
            self.e2e_latency.observe(value)
        for reason in iteration_stats.finish_reasons:
            self._request_success.labels(self.model_name, reason).inc()

    def expose(self) -> bytes:
        """The text exposition format of every metric."""
        return prometheus_client.generate_latest(self.registry)
