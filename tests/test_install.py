"""The Makefile's torch line takes the CPU build of torch, wherever it runs.

``make install`` (what ``make demo`` and ``make test`` run first) asks for ``torch==X+cpu`` with
PyTorch's CPU wheel index as an extra index. These tests take that exact command from
``make -n install`` and let pip resolve it in dry-run mode (``pip install --dry-run --report``)
against package indexes written here, so nothing is downloaded and no network is needed:

- an ordinary Linux machine: "PyPI" offers only the CUDA build of torch (which pulls NVIDIA
  packages) and the CPU index offers ``+cpu``: the CPU build is chosen, and the old requirement
  (plain ``torch==X`` from PyPI alone) is shown to take the CUDA build;
- a machine like this one: the CPU index cannot be reached, a local wheel of the ``+cpu`` build
  is there (``--find-links``): pip skips the index quickly and takes the local wheel.

The real indexes (pypi.org and download.pytorch.org) are not used here; the same resolution
against them is a command to run by hand (docs in the Makefile's comment):
``pip install --dry-run --report - --extra-index-url https://download.pytorch.org/whl/cpu
"torch==2.13.0+cpu"``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def makefile_torch_command(torch_index: str) -> list[str]:
    """The Makefile's torch install command (``make -n install``), with the CPU index URL
    replaced and the pip of this interpreter."""
    # Run as a make of its own even under `make test` (no parent's flags or level).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(
        ["make", "-n", "-s", "-C", str(REPO), "install", f"PYTHON={sys.executable}",
         f"TORCH_INDEX={torch_index}"],
        capture_output=True, text=True, check=True, env=env,
    )
    first = shlex.split(done.stdout.splitlines()[0])
    assert first[:4] == [sys.executable, "-m", "pip", "install"], done.stdout
    assert any(arg.startswith("torch==") for arg in first), done.stdout
    return first


def _wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A minimal pure-Python wheel (metadata only) named like a real one."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist_info}/METADATA", metadata)
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return path


def _index(root: Path, wheels: dict[str, list[Path]]) -> str:
    """A PEP 503 simple index at ``root`` listing ``wheels`` per project; its file:// URL."""
    for project, files in wheels.items():
        page = root / project
        page.mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="{f.as_uri()}">{f.name}</a>\n' for f in files)
        (page / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return root.as_uri()


# torch's own dependencies, as small stand-ins (pip looks each one up on every index).
DEPS = {"filelock": "3.20.0", "sympy": "1.14.0", "networkx": "3.6.1", "jinja2": "3.1.6"}


@pytest.fixture
def indexes(tmp_path: Path) -> dict[str, str]:
    """``pypi``: torch 2.13.0 as its CUDA build (needs an NVIDIA package) and torch's
    dependencies; ``cpu``: PyTorch's CPU index with 2.13.0+cpu; ``local``: a folder holding the
    +cpu wheel (like this machine's /opt/wheels)."""
    files = tmp_path / "files"
    requires = [f"{name}=={version}" for name, version in DEPS.items()]
    cuda = _wheel(files / "pypi", "torch", "2.13.0", [*requires, "nvidia-cublas-cu12==12.8.4.1"])
    nvidia = _wheel(files / "pypi", "nvidia_cublas_cu12", "12.8.4.1")
    deps = {name: [_wheel(files / "pypi", name, version)] for name, version in DEPS.items()}
    cpu = _wheel(files / "cpu", "torch", "2.13.0+cpu", requires)
    local = tmp_path / "local-wheels"
    local.mkdir()
    shutil.copy(cpu, local)
    return {
        "pypi": _index(tmp_path / "pypi",
                       {"torch": [cuda], "nvidia-cublas-cu12": [nvidia], **deps}),
        "cpu": _index(tmp_path / "cpu", {"torch": [cpu]}),
        "local": str(local),
    }


def resolve(command: list[str], index_url: str, tmp_path: Path, *extra: str) -> dict[str, str]:
    """Run ``command`` in pip's dry-run mode with only ``index_url`` as the main index (machine
    configuration ignored); return {name: version} of what pip would install."""
    report = tmp_path / f"report-{time.monotonic_ns()}.json"
    done = subprocess.run(
        [*command, "--dry-run", "--ignore-installed", "--report", str(report), "--isolated",
         "--no-cache-dir", "--disable-pip-version-check", "--index-url", index_url, *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    installs = json.loads(report.read_text())["install"]
    return {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
            for item in installs}


def test_makefile_takes_the_cpu_build_from_the_pytorch_cpu_index(indexes, tmp_path):
    command = makefile_torch_command(indexes["cpu"])
    resolved = resolve(command, indexes["pypi"], tmp_path)
    assert resolved == {"torch": "2.13.0+cpu", **DEPS}
    # Without the CPU index, what the Makefile used to ask for takes the CUDA build.
    old = [sys.executable, "-m", "pip", "install", "torch==2.13.0"]
    assert resolve(old, indexes["pypi"], tmp_path) == {
        "torch": "2.13.0", "nvidia-cublas-cu12": "12.8.4.1", **DEPS}


def test_unreachable_cpu_index_is_skipped_quickly_for_a_local_wheel(indexes, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on: connection refused at once
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    command = makefile_torch_command(f"http://127.0.0.1:{closed}/simple")
    start = time.perf_counter()
    resolved = resolve(command, indexes["pypi"], tmp_path, "--find-links", indexes["local"])
    assert resolved == {"torch": "2.13.0+cpu", **DEPS}
    # pip looks up torch and each dependency on the unreachable index; with its default 5
    # retries that backs off for about 9 s per project (45 s here, a minute and a half for the
    # real torch); the Makefile's --retries 1 keeps it to seconds.
    assert time.perf_counter() - start < 20
