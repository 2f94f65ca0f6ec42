"""The CPU backend passes Octavo's backend conformance suite, run as a backend author runs it:
``pytest --octavo-backend cpu --pyargs octavo.testing.conformance`` in a fresh process."""

from __future__ import annotations

import pkgutil

import octavo.testing.conformance
from octavo.testing import run_conformance

SUITE_MODULES = {m.name for m in pkgutil.iter_modules(octavo.testing.conformance.__path__)
                 if m.name.startswith("test_")}


def test_cpu_backend_passes_the_conformance_suite():
    report = run_conformance("cpu", timeout_s=600)
    assert report.ok, report.summary()
    assert not report.with_outcome("skipped"), report.summary()
    assert report.modules == SUITE_MODULES, report.summary()
    # Every dtype the backend declares was checked in the kernels.
    for dtype in ("float32", "bfloat16", "float16"):
        assert any(f"[{dtype}-" in case.test_id for case in report.cases), dtype
