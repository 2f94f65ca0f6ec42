"""Prometheus metrics of the server (``GET /metrics``), named as vLLM names them.

``PrometheusStatLogger`` is an ``AsyncLLM`` stat logger: it is called after every engine-core
step with the scheduler's snapshot and what the front end saw in that step. Every series is
``octavo:<name>``, where ``<name>`` is vLLM's own (``prompt_tokens_total``,
``time_to_first_token_seconds``, ...), so a vLLM dashboard needs only its prefix changed; with
``vllm_names`` each series is exported under ``vllm:<name>`` as well, and existing Grafana
boards work unchanged. Metrics live in their own ``CollectorRegistry`` (never the global one),
labelled with the served model name.

With several API server processes (``--api-server-count``; ``multiprocess``) prometheus_client's
multiprocess mode is on (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor before they
start): every process writes its values to files there, and ``expose`` adds up every process's
counters and histograms. Gauges (the engine core's snapshot, which every process receives)
take the most recently written value. Counters derived from the engine core's running totals
(prefix cache, preemptions, speculative decoding) and the per-step token histogram are counted
by one process only (``engine_counters``), or they would count N times.
"""

from __future__ import annotations

import os
from bisect import bisect_left

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from octavo.config import PREEMPTION_MODES
from octavo.engine.stats import IterationStats
from octavo.messages import SchedulerStats

# Counters expose only ``*_total`` (no ``*_created`` series).
prometheus_client.disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_N_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

# (name without prefix, kind, help) of every metric, for the docs and the tests.
METRICS = (
    ("num_requests_running", "gauge", "Requests in the engine's running batch."),
    ("num_requests_waiting", "gauge", "Requests waiting to run (new or preempted)."),
    ("num_requests_swapped", "gauge", "Requests preempted by swapping, their KV blocks in host memory."),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks held by requests (0 to 1)."),
    ("cpu_cache_usage_perc", "gauge", "Fraction of the host KV block pool (--swap-space) held by swapped requests (0 to 1)."),
    ("prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens looked up, since start."),
    ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "counter", "Requests preempted to free KV blocks, by mode (recompute, swap)."),
    ("prompt_tokens", "counter", "Prompt tokens of admitted requests."),
    ("generation_tokens", "counter", "Generated tokens."),
    ("request_success", "counter", "Finished completions, by finished_reason (stop, length, abort)."),
    ("iteration_tokens_total", "histogram", "Tokens (prompt chunks and decodes) per engine step."),
    ("time_to_first_token_seconds", "histogram", "Seconds from arrival to the first generated token."),
    ("inter_token_latency_seconds", "histogram", "Seconds between two tokens of one completion."),
    ("time_per_output_token_seconds", "histogram", "Per finished request: decode time / (generated tokens - 1)."),
    ("e2e_request_latency_seconds", "histogram", "Seconds from arrival to the end of a request."),
    ("request_queue_time_seconds", "histogram", "Seconds a request waited before it was first scheduled."),
    ("request_prefill_time_seconds", "histogram", "Seconds from first scheduling to the first token."),
    ("request_decode_time_seconds", "histogram", "Seconds from the first token to the end."),
    ("request_inference_time_seconds", "histogram", "Seconds from first scheduling to the end."),
    ("request_prompt_tokens", "histogram", "Prompt tokens per finished request."),
    ("request_generation_tokens", "histogram", "Generated tokens per finished request (all its completions)."),
    ("request_params_n", "histogram", "The n of each finished request."),
    ("request_params_max_tokens", "histogram", "The max_tokens of each finished request that set one."),
    ("spec_decode_num_drafts", "counter", "Speculative decoding: request steps that verified draft tokens."),
    ("spec_decode_num_draft_tokens", "counter", "Speculative decoding: draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "counter", "Speculative decoding: draft tokens accepted."),
    ("spec_decode_num_accepted_tokens_per_pos", "counter", "Speculative decoding: draft tokens accepted, by position in the draft (label position, 0 = first)."),
)

_BUCKETS = {
    "iteration_tokens_total": _TOKEN_BUCKETS,
    "time_to_first_token_seconds": _LATENCY_BUCKETS,
    "inter_token_latency_seconds": _LATENCY_BUCKETS,
    "time_per_output_token_seconds": _LATENCY_BUCKETS,
    "request_prompt_tokens": _TOKEN_BUCKETS,
    "request_generation_tokens": _TOKEN_BUCKETS,
    "request_params_n": _N_BUCKETS,
    "request_params_max_tokens": _TOKEN_BUCKETS,
}


class _Series:
    """One metric under every prefix it is exported with (``octavo:``, maybe ``vllm:``)."""

    def __init__(self, metrics: list) -> None:
        self._metrics = metrics
        # Histograms: their bucket bounds, when the whole-step path of observe_all can use them.
        self._bounds: list[float] | None = None
        if metrics and all(_batchable(m) for m in metrics):
            bounds = [list(m._upper_bounds) for m in metrics]
            if all(b == bounds[0] for b in bounds):
                self._bounds = bounds[0]

    def set(self, value: float) -> None:
        for metric in self._metrics:
            metric.set(value)

    def inc(self, value: float = 1) -> None:
        for metric in self._metrics:
            metric.inc(value)

    def observe(self, value: float) -> None:
        for metric in self._metrics:
            metric.observe(value)

    def observe_all(self, values: list[float]) -> None:
        """``observe`` each value; a histogram gets one addition per bucket that any value
        falls in (and one to its sum), not one per value.

        The inter-token latencies come one per request per step (256 a step at 256 requests):
        observed one by one they cost ~0.75 us of API CPU per streamed token, ~2 us with
        several API processes (each ``inc`` then writes a shared file), 4-10 % of the total.
        prometheus_client has no batch observe; this uses the fields its ``observe`` uses
        (``_upper_bounds``, ``_buckets``, ``_sum``), and observes one by one where they are
        missing. The counts are the same; the sum differs only in float rounding.
        """
        if not values:
            return
        bounds = self._bounds
        if bounds is None:
            for value in values:
                self.observe(value)
            return
        counts: dict[int, int] = {}
        for value in values:
            # observe() puts a value in the first bucket whose bound is >= it (the last is +Inf).
            index = bisect_left(bounds, value)
            counts[index] = counts.get(index, 0) + 1
        total = sum(values)
        for metric in self._metrics:
            metric._sum.inc(total)
            buckets = metric._buckets
            for index, count in counts.items():
                buckets[index].inc(count)


def _batchable(metric: object) -> bool:
    """Whether ``metric`` is a prometheus_client histogram with the fields observe_all uses."""
    bounds = getattr(metric, "_upper_bounds", None)
    return (isinstance(metric, Histogram) and bounds is not None
            and bounds[-1] == float("inf") and hasattr(metric, "_sum")
            and len(getattr(metric, "_buckets", ())) == len(bounds))


class PrometheusStatLogger:
    """Turns engine snapshots into Prometheus metrics.

    :param vllm_names: also export every series as ``vllm:<name>``.
    :param multiprocess: one of several API server processes (see the module's docstring).
    :param engine_counters: count what comes from the engine core's totals (False in all
        API server processes but one).
    """

    def __init__(self, model_name: str, vllm_names: bool = False, multiprocess: bool = False,
                 engine_counters: bool = True) -> None:
        if multiprocess and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            raise RuntimeError("multiprocess metrics need PROMETHEUS_MULTIPROC_DIR (set by the "
                               "--api-server-count supervisor before the processes start)")
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        self.engine_counters = engine_counters
        # Gauges of the engine core's snapshot: the latest value any process wrote.
        gauge_mode = {"multiprocess_mode": "mostrecent"} if multiprocess else {}
        self.prefixes = ("octavo", "vllm") if vllm_names else ("octavo",)
        self.model_name = model_name
        kinds = {name: (kind, text) for name, kind, text in METRICS}
        self._series: dict[str, _Series] = {}
        self._request_success: list[Counter] = []
        self._preemptions: list[Counter] = []
        self._accepted_per_pos: list[Counter] = []
        for name, (kind, text) in kinds.items():
            made = []
            for prefix in self.prefixes:
                full = f"{prefix}:{name}"
                if name == "request_success":
                    counter = Counter(full, text, ["model_name", "finished_reason"],
                                      registry=self.registry)
                    for reason in ("stop", "length", "abort"):
                        counter.labels(model_name, reason)  # exported as 0 from the start
                    self._request_success.append(counter)
                    continue
                if name == "num_preemptions":
                    counter = Counter(full, text, ["model_name", "mode"], registry=self.registry)
                    for mode in PREEMPTION_MODES:
                        counter.labels(model_name, mode)  # exported as 0 from the start
                    self._preemptions.append(counter)
                    continue
                if name == "spec_decode_num_accepted_tokens_per_pos":
                    self._accepted_per_pos.append(Counter(
                        full, text, ["model_name", "position"], registry=self.registry))
                    continue
                if kind == "gauge":
                    metric = Gauge(full, text, ["model_name"], registry=self.registry,
                                   **gauge_mode)
                elif kind == "counter":
                    metric = Counter(full, text, ["model_name"], registry=self.registry)
                else:
                    metric = Histogram(full, text, ["model_name"], registry=self.registry,
                                       buckets=_BUCKETS.get(name, _REQUEST_BUCKETS))
                made.append(metric.labels(model_name))
            self._series[name] = _Series(made)
        self._last_num_preemptions = {mode: 0 for mode in PREEMPTION_MODES}
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_spec = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                           "spec_decode_num_accepted_tokens": 0}
        self._last_accepted_per_pos: list[int] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        s, sched, it = self._series, scheduler_stats, iteration_stats
        s["num_requests_running"].set(sched.num_running)
        s["num_requests_waiting"].set(sched.num_waiting)
        s["num_requests_swapped"].set(sched.num_swapped)
        s["kv_cache_usage_perc"].set(sched.kv_cache_usage)
        s["cpu_cache_usage_perc"].set(sched.host_kv_cache_usage)
        s["prefix_cache_hit_rate"].set(sched.prefix_cache_hit_rate)
        if self.engine_counters:
            self._count_preemptions(sched)
            self._count_since_last("prefix_cache_queries", sched.prefix_cache_queries,
                                   "_last_prefix_queries")
            self._count_since_last("prefix_cache_hits", sched.prefix_cache_hits,
                                   "_last_prefix_hits")
            self._count_spec_decode(sched)
        if it.num_prompt_tokens:
            s["prompt_tokens"].inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            s["generation_tokens"].inc(it.num_generation_tokens)
            if self.engine_counters:
                s["iteration_tokens_total"].observe(sched.num_batched_tokens)
        s["time_to_first_token_seconds"].observe_all(it.time_to_first_tokens)
        s["inter_token_latency_seconds"].observe_all(it.inter_token_latencies)
        for done in it.finished_requests:
            s["e2e_request_latency_seconds"].observe(done.e2e_latency)
            s["request_queue_time_seconds"].observe(done.queue_time)
            s["request_prefill_time_seconds"].observe(done.prefill_time)
            s["request_decode_time_seconds"].observe(done.decode_time)
            s["request_inference_time_seconds"].observe(done.inference_time)
            if done.time_per_output_token is not None:
                s["time_per_output_token_seconds"].observe(done.time_per_output_token)
            s["request_prompt_tokens"].observe(done.num_prompt_tokens)
            s["request_generation_tokens"].observe(done.num_generation_tokens)
            s["request_params_n"].observe(done.n)
            if done.max_tokens is not None:
                s["request_params_max_tokens"].observe(done.max_tokens)
        for reason in it.finish_reasons:
            for counter in self._request_success:
                counter.labels(self.model_name, reason).inc()

    def _count_preemptions(self, sched: SchedulerStats) -> None:
        totals = {"swap": sched.num_preemptions_swap,
                  "recompute": sched.num_preemptions - sched.num_preemptions_swap}
        for mode, total in totals.items():
            new = total - self._last_num_preemptions[mode]
            if new > 0:
                for counter in self._preemptions:
                    counter.labels(self.model_name, mode).inc(new)
            self._last_num_preemptions[mode] = total

    def _count_spec_decode(self, sched: SchedulerStats) -> None:
        for name, last in self._last_spec.items():
            total = getattr(sched, name)
            if total > last:
                self._series[name].inc(total - last)
            self._last_spec[name] = total
        per_pos = sched.spec_decode_num_accepted_tokens_per_pos
        last_per_pos = self._last_accepted_per_pos
        for position, total in enumerate(per_pos):
            new = total - (last_per_pos[position] if position < len(last_per_pos) else 0)
            for counter in self._accepted_per_pos:
                series = counter.labels(self.model_name, str(position))  # shown from here on
                if new > 0:
                    series.inc(new)
        self._last_accepted_per_pos = list(per_pos)

    def _count_since_last(self, name: str, total: int, last_attr: str) -> None:
        """Counters of the engine core arrive as totals since start: add what is new."""
        new = total - getattr(self, last_attr)
        if new > 0:
            self._series[name].inc(new)
        setattr(self, last_attr, total)

    def expose(self) -> bytes:
        """The text exposition format of every metric (of every API server process, in
        multiprocess mode)."""
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return prometheus_client.generate_latest(registry)
        return prometheus_client.generate_latest(self.registry)
