"""``octavo bench serve``'s maths on synthetic timings: arrival times, the dataset, latency
metrics, goodput, peak throughput and in-flight counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from octavo.benchmarks.serve_client import arrival_times, length_range, random_dataset
from octavo.benchmarks.serve_metrics import (
    RequestResult,
    calculate_metrics,
    max_in_flight,
    parse_goodput,
    peak_output_throughput,
)
from octavo.cli.bench import make_workload


def result(start: float, chunk_offsets: list[float], end: float, prompt_len: int = 10,
           output_len: int | None = None) -> RequestResult:
    """A successful request sent at ``start`` whose chunks came at ``start + offset``."""
    times = [start + t for t in chunk_offsets]
    return RequestResult(prompt_len=prompt_len, success=True,
                         output_len=len(times) if output_len is None else output_len,
                         start_time=start, chunk_times=times, ttft=chunk_offsets[0],
                         latency=end)


# ---- arrival times -----------------------------------------------------------------------------


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    times = arrival_times(20_000, 50.0, 1.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (coefficient of variation 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_spread(burstiness):
    gaps = np.diff(arrival_times(20_000, 10.0, burstiness, seed=2))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # Gamma of shape k: coefficient of variation 1 / sqrt(k) (burstier below 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_arrivals_are_deterministic_for_a_seed():
    assert arrival_times(50, 5.0, 1.0, seed=3) == arrival_times(50, 5.0, 1.0, seed=3)
    assert arrival_times(50, 5.0, 1.0, seed=3) != arrival_times(50, 5.0, 1.0, seed=4)


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (5.0, 0.0)])
def test_bad_rates_are_refused(rate, burstiness):
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_times(3, rate, burstiness, seed=0)


# ---- dataset -----------------------------------------------------------------------------------


def test_dataset_lengths_prefix_and_vocabulary():
    data = random_dataset(200, 40, 10, 0.5, 7, vocab_size=100, seed=0)
    assert length_range(40, 0.5) == (20, 60) and length_range(10, 0.5) == (5, 15)
    prefix = data[0].prompt_token_ids[:7]
    for request in data:
        assert request.prompt_token_ids[:7] == prefix
        assert 20 + 7 <= len(request.prompt_token_ids) <= 60 + 7
        assert 5 <= request.output_len <= 15
        assert all(0 <= t < 100 for t in request.prompt_token_ids)


def test_dataset_is_bench_throughputs_workload():
    data = random_dataset(16, 64, 8, 0.0, 0, vocab_size=1000, seed=5)
    workload = make_workload(16, (64, 64), (8, 8), 1000, 5)
    assert [r.prompt_token_ids for r in data] == workload.prompts
    assert [r.output_len for r in data] == workload.output_lens == [8] * 16


def test_range_ratio_must_be_below_one():
    with pytest.raises(ValueError, match="range-ratio"):
        length_range(10, 1.0)


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics_of_known_timings():
    # Request A: sent at 0, chunks at 0.1, 0.2, 0.4 -> TTFT 0.1, ITL 0.1 and 0.2, E2EL 0.5,
    # TPOT (0.5 - 0.1) / 2 = 0.2. Request B: sent at 1, one chunk at 1.3, ends at 1.3.
    a = result(0.0, [0.1, 0.2, 0.4], end=0.5, prompt_len=5)
    b = result(1.0, [0.3], end=0.3, prompt_len=7)
    failed = RequestResult(prompt_len=100, error="HTTP 500: boom", start_time=0.0, latency=0.01)
    m = calculate_metrics([a, b, failed], duration_s=2.0, percentiles=(50.0, 99.0))
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 12, 4)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.0)
    assert m.total_token_throughput == pytest.approx(8.0)
    assert m.ttft.mean == pytest.approx(200.0) and m.ttft.median == pytest.approx(200.0)
    assert m.itl.mean == pytest.approx(150.0)
    assert m.itl.percentiles[99.0] == pytest.approx(100 + 0.99 * 100)
    assert m.tpot.mean == pytest.approx(200.0)  # only A has more than one token
    assert m.e2el.mean == pytest.approx(400.0)
    assert m.request_goodput is None
    assert m.total_chunks == 4  # the failed request's are not counted


def test_percentiles_are_ordered_and_e2el_bounds_ttft():
    rng = np.random.default_rng(0)
    results = []
    for i in range(100):
        offsets = np.cumsum(rng.exponential(0.02, size=int(rng.integers(1, 30)))).tolist()
        results.append(result(i * 0.01, offsets, end=offsets[-1] + 0.001))
    m = calculate_metrics(results, duration_s=5.0, percentiles=(50.0, 90.0, 99.0))
    for dist in (m.ttft, m.tpot, m.itl, m.e2el):
        p = dist.percentiles
        assert p[50.0] <= p[90.0] <= p[99.0]
        assert p[50.0] == pytest.approx(dist.median)
    assert m.e2el.mean >= m.ttft.mean and m.e2el.percentiles[99.0] >= m.ttft.percentiles[99.0]


def test_goodput_counts_requests_meeting_every_slo():
    fast = result(0.0, [0.05, 0.06, 0.07], end=0.08)  # TTFT 50 ms, TPOT 15 ms
    slow_start = result(0.0, [0.5, 0.51], end=0.52)  # TTFT 500 ms
    slow_tokens = result(0.0, [0.05, 0.25], end=0.45)  # TPOT 400 ms
    single = result(0.0, [0.1], end=0.1)  # one token: any TPOT SLO is met
    runs = [fast, slow_start, slow_tokens, single]
    slos = parse_goodput(["ttft:200", "tpot:100"])
    assert slos == {"ttft": 0.2, "tpot": 0.1}
    assert calculate_metrics(runs, 1.0, slos).request_goodput == pytest.approx(2.0)
    assert calculate_metrics(runs, 1.0, parse_goodput(["e2el:100"])).request_goodput == 2.0


@pytest.mark.parametrize("items,message", [
    (["ttft"], "NAME:MS"), (["latency:5"], "NAME:MS"), (["tpot:-1"], "milliseconds > 0"),
    (["tpot:abc"], "milliseconds > 0"),
])
def test_bad_goodput_is_refused(items, message):
    with pytest.raises(ValueError, match=message):
        parse_goodput(items)


def test_peak_output_throughput_counts_the_busiest_second():
    # 3 chunks in [0, 1), then 5 within 0.5 s at t = 2, then 1 more at 3.5.
    a = result(0.0, [0.1, 0.5, 0.9], end=1.0)
    b = result(2.0, [0.0, 0.1, 0.2, 0.3, 0.4], end=0.5)
    c = result(3.0, [0.5], end=0.6)
    assert peak_output_throughput([a, b, c]) == 5.0
    assert peak_output_throughput([]) == 0.0


def test_max_in_flight_from_records():
    # [0, 1), [0.5, 2), [1, 1.5) (starts as the first ends: not overlapping it), [3, 4).
    spans = [(0.0, 1.0), (0.5, 1.5), (1.0, 0.5), (3.0, 1.0)]
    records = [RequestResult(prompt_len=1, start_time=s, latency=d) for s, d in spans]
    assert max_in_flight(records) == 2
