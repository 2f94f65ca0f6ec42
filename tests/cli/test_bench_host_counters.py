"""The host counters ``octavo bench throughput`` prints beside a run: the machine's CPU
seconds from ``/proc/stat`` and the engine thread's CPU time and involuntary switches."""

from __future__ import annotations

import os
import sys

import pytest
from octavo.cli.bench import machine_cpu_seconds
from octavo.engine_core.core import thread_usage


def test_machine_cpu_seconds_reads_the_cpu_line(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 400 50 6 4 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    hz = os.sysconf("SC_CLK_TCK")
    busy, steal, total = machine_cpu_seconds(str(stat))
    assert busy == pytest.approx(160 / hz) and steal == pytest.approx(40 / hz)
    assert total == pytest.approx(650 / hz)
    assert machine_cpu_seconds(str(tmp_path / "absent")) is None
    stat.write_text("not a stat file\n")
    assert machine_cpu_seconds(str(stat)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_machine_cpu_seconds_on_this_machine_grow():
    before = machine_cpu_seconds()
    sum(range(2_000_000))
    after = machine_cpu_seconds()
    assert before is not None and after is not None
    assert all(b >= a for a, b in zip(before, after)) and after[2] > 0


def test_thread_usage_counts_this_threads_cpu():
    cpu_before, switches_before = thread_usage()
    sum(range(2_000_000))
    cpu_after, switches_after = thread_usage()
    assert cpu_after > cpu_before
    assert switches_after >= switches_before >= 0
