"""``_Series.observe_all``: a step's values added bucket by bucket give the same histogram as
``observe`` per value, in one process and in prometheus_client's multiprocess mode (which
prometheus_client picks when it is imported: that case runs in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from octavo.entrypoints.openai.metrics import PrometheusStatLogger, _Series

NAME = "inter_token_latency_seconds"


def histogram_samples(batched: bool, multiprocess: bool) -> dict[str, float]:
    """Record the same values batched (``record``) or one by one (``observe``); return the
    exposition's samples of the histogram under every prefix."""
    from octavo.engine.stats import IterationStats
    from octavo.messages import SchedulerStats
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    rng = random.Random(0)
    # Values on the bucket bounds too (a value equal to a bound is in that bucket).
    values = [rng.choice([0.01, 0.025, 0.1, 1e-4, 0.0, 99.0, 1e9, rng.random() / 10])
              for _ in range(500)]
    logger = PrometheusStatLogger("m", vllm_names=True, multiprocess=multiprocess)
    series = logger._series[NAME]
    assert series._bounds is not None, "the histogram's batch path is not in use"
    for start in range(0, len(values), 50):  # 50 values a step
        step = values[start:start + 50]
        if batched:
            logger.record(SchedulerStats.idle(), IterationStats(inter_token_latencies=step))
        else:
            for value in step:
                series.observe(value)
    text = logger.expose() if multiprocess else generate_latest(logger.registry)
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text.decode())
            if family.name.endswith(NAME) for s in family.samples}


def _in_multiprocess_mode(batched: bool, folder: str) -> dict[str, float]:
    code = ("import json; from tests.entrypoints.openai.test_metrics_batch import "
            f"histogram_samples as h; print(json.dumps(h({batched}, True)))")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": folder}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("multiprocess", [False, True], ids=["single", "multiprocess"])
def test_observe_all_equals_observe_per_value(multiprocess, tmp_path) -> None:
    results = []
    for batched in (True, False):
        if multiprocess:
            folder = tmp_path / str(batched)
            folder.mkdir()
            results.append(_in_multiprocess_mode(batched, str(folder)))
        else:
            results.append(histogram_samples(batched, False))
    batched, one_by_one = results
    # Two prefixes, each with its buckets, _count and _sum.
    assert batched.keys() == one_by_one.keys() and len(batched) > 2 * 10
    for key, value in one_by_one.items():
        assert batched[key] == pytest.approx(value, rel=1e-12), key


def test_observe_all_falls_back_to_observe_per_value() -> None:
    """A metric without the histogram fields goes through observe one by one."""
    seen = []

    class Recorder:
        def observe(self, value: float) -> None:
            seen.append(value)

    series = _Series([Recorder()])
    assert series._bounds is None
    series.observe_all([0.5, 2.0])
    assert seen == [0.5, 2.0]
