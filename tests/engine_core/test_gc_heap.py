"""``octavo.engine_core.gc_heap``: start-up's objects frozen, the collector's thresholds set.

Run in a child interpreter: freezing and the thresholds are process-wide, and the test
session's own process must keep Python's collector as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from octavo import envs

_CHILD = """
import gc, json
from octavo.engine_core.gc_heap import freeze_startup_objects
before = gc.get_freeze_count()
freeze_startup_objects()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count() - before}))
"""


def _child(threshold: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OCTAVO_GC_THRESHOLD"}
    if threshold is not None:
        env["OCTAVO_GC_THRESHOLD"] = threshold
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_start_up_objects_are_frozen_and_the_thresholds_raised():
    result = _child(None)
    assert result["frozen"] > 1000  # the modules octavo imported, at least
    assert result["threshold"] == [50000, 20, 100]


def test_the_thresholds_come_from_the_environment():
    assert _child("700,10,10")["threshold"] == [700, 10, 10]


@pytest.mark.parametrize("raw", ["700,10", "a,b,c", "0,10,10", "700,-1,10", ""])
def test_a_malformed_threshold_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("OCTAVO_GC_THRESHOLD", raw)
    with pytest.raises(ValueError, match="OCTAVO_GC_THRESHOLD must be three comma-separated"):
        envs.gc_threshold()
