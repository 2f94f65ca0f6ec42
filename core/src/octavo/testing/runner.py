"""Run the conformance suite for one backend in a fresh Python process and read its outcome.

``run_conformance("cpu")`` is what a backend's own test suite calls (Octavo's do, for ``cpu``,
``cuda`` and the template plugin): the run gets its own process, so the suite's engines,
plugin manager and device state never mix with the caller's, and its result comes back as a
typed report parsed from pytest's JUnit XML.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

SUITE = "octavo.testing.conformance"
OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One test of the suite."""

    # "octavo.testing.conformance.test_memory::test_kv_cache_memory_is_sane".
    test_id: str
    # One of OUTCOMES.
    outcome: str
    # The failure, error or skip message ("" when passed).
    message: str

    @property
    def module(self) -> str:
        """The test module's short name, e.g. ``test_memory``."""
        return self.test_id.split("::")[0].rsplit(".", 1)[-1]


@dataclass(frozen=True, slots=True)
class ConformanceReport:
    """What one run of the suite did."""

    # The backend checked.
    backend: str
    # pytest's exit status (0: every collected test passed).
    returncode: int
    # Every test that ran, in order.
    cases: tuple[CaseResult, ...]
    # pytest's stdout and stderr.
    output: str
    # Wall time of the run, in seconds.
    duration_s: float

    def with_outcome(self, outcome: str) -> list[CaseResult]:
        return [case for case in self.cases if case.outcome == outcome]

    @property
    def ok(self) -> bool:
        """At least one test ran, and none failed or errored."""
        return (self.returncode == 0 and bool(self.cases)
                and not self.with_outcome("failed") and not self.with_outcome("error"))

    @property
    def modules(self) -> set[str]:
        return {case.module for case in self.cases}

    def summary(self, tail_chars: int = 6000) -> str:
        """Counts, the tests that did not pass, and the end of pytest's output."""
        counts = ", ".join(f"{len(self.with_outcome(o))} {o}" for o in OUTCOMES)
        lines = [(f"conformance of backend {self.backend!r}: {counts} in {self.duration_s:.1f} s "
                  f"(pytest exit status {self.returncode})")]
        lines += [f"  {c.outcome.upper()} {c.test_id}: {c.message[:300]}"
                  for c in self.cases if c.outcome != "passed"]
        lines.append(self.output[-tail_chars:])
        return "\n".join(lines)


def run_conformance(
    backend: str,
    *pytest_args: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    host_threads: int | None = 1,
) -> ConformanceReport:
    """Run ``pytest --octavo-backend BACKEND --pyargs octavo.testing.conformance``.

    The run happens in an empty temporary folder, so no project's pytest configuration
    applies.

    :param backend: installed backend to check (what ``--device`` takes).
    :param pytest_args: extra pytest arguments (e.g. ``"-k", "attention"``).
    :param env: variables added to this process's environment for the run.
    :param timeout_s: kill the run after this many seconds (``subprocess.TimeoutExpired``).
    :param host_threads: torch's host threads in the run (``OMP_NUM_THREADS``; ``None``
        leaves the environment's). The suite's models are tiny: one thread computes them as
        fast, and, unlike several, does not slow down tenfold on a machine that other
        processes keep busy.
    """
    with tempfile.TemporaryDirectory(prefix="octavo-conformance-") as tmp:
        report_path = Path(tmp) / "report.xml"
        command = [
            sys.executable, "-m", "pytest", "--octavo-backend", backend, "--pyargs", SUITE,
            f"--junit-xml={report_path}", "-p", "no:cacheprovider", "-rfEs",
            *pytest_args,
        ]
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=tmp, env=_environment(env, host_threads), capture_output=True,
            text=True, timeout=timeout_s, check=False,
        )
        duration = time.perf_counter() - start
        cases = _read_junit(report_path) if report_path.exists() else ()
    return ConformanceReport(
        backend=backend, returncode=done.returncode, cases=cases,
        output=done.stdout + done.stderr, duration_s=duration,
    )


def _environment(extra: Mapping[str, str] | None, host_threads: int | None) -> dict[str, str]:
    environment = dict(os.environ)
    if host_threads is not None:
        environment["OMP_NUM_THREADS"] = str(host_threads)
    environment.update(extra or {})
    return environment


def _read_junit(path: Path) -> tuple[CaseResult, ...]:
    cases = []
    for element in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        # A test can fail in its call and error in its teardown: the error wins.
        for tag in ("skipped", "failure", "error"):
            child = element.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = child.get("message") or (child.text or "")
        test_id = f"{element.get('classname', '')}::{element.get('name', '')}"
        cases.append(CaseResult(test_id=test_id, outcome=outcome, message=message))
    return tuple(cases)
