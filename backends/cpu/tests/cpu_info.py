"""What the CPU the tests run on reports (shared by the CPU backend's tests)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The instruction-set flags of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
