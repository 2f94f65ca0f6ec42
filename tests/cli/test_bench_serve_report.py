"""``octavo bench serve``'s report of its own client: the busiest process's CPU share."""

from __future__ import annotations

import pytest
from octavo.benchmarks.serve_client import RunResult
from octavo.cli.bench_serve import CLIENT_SATURATED, client_busiest_fraction


def test_the_busiest_client_process_is_its_cpu_over_the_runs_wall_time():
    run = RunResult([], duration_s=2.0, max_in_flight=0, client_cpu_s=(0.5, 1.9, 1.2))
    assert client_busiest_fraction(run) == pytest.approx(0.95)
    assert client_busiest_fraction(run) >= CLIENT_SATURATED


def test_no_cpu_figure_or_no_duration_reads_as_idle():
    assert client_busiest_fraction(RunResult([], 2.0, 0)) == 0.0
    assert client_busiest_fraction(RunResult([], 0.0, 0, (0.1,))) == 0.0
