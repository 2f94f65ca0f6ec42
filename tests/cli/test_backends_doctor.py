"""``octavo backends``, the doctor's view: every installed backend with its package, priority,
availability here (and why not) and capabilities, as text and as ``--json``; and selecting an
installed backend that cannot run here says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import octavo.plugins
import pytest
from octavo.backends import Availability, Backend, BackendCapabilities, select_backend
from octavo.cli.main import main
from octavo.hookspecs import hookimpl
from octavo.plugins import build_plugin_manager

from tests.helpers import restricted_backend

REPO = Path(__file__).resolve().parents[2]
CAPABILITY_FIELDS = [f.name for f in fields(BackendCapabilities)]


@pytest.fixture
def with_restricted():
    """The restricted test backend on the process-wide manager, for one test."""
    pm = octavo.plugins.get_plugin_manager()
    name = pm.register(restricted_backend, name="test-restricted")
    pm.check_pending()
    try:
        yield
    finally:
        pm.unregister(name=name)


def _json(capsys) -> dict:
    assert main(["backends", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_every_capability_of_every_backend(with_restricted, capsys):
    data = _json(capsys)
    rows = {row["name"]: row for row in data["backends"]}
    row = rows["restricted"]
    assert row == {
        "name": "restricted", "package": "octavo-test-restricted", "priority": -10,
        "device_type": "cpu", "dist_backend": "gloo",
        "description": "test backend with tight declared limits",
        "available": True, "reason": restricted_backend.REASON, "default": False,
        "ranks_here": None,  # the host: a process per rank
        "capabilities": {
            "dtypes": ["float32"], "head_dims": [16, 64], "block_sizes": [16],
            "cuda_graphs": False, "cuda_graphs_multi_token": False,
            "async_scheduling": False, "default_max_num_batched_tokens": 2048,
            "max_num_seqs": 8, "max_model_len": 128,
            "prompt_logprobs": False, "max_logprobs": 2, "quantization_methods": [],
            "kv_cache_dtypes": ["auto"], "sliding_window": False,
            "logits_soft_cap": False,
        },
    }
    for other in data["backends"]:
        assert list(other["capabilities"]) == CAPABILITY_FIELDS
    assert [r["name"] for r in data["backends"] if r["default"]] == [data["default"]]
    assert rows["cpu"]["capabilities"]["head_dims"] is None  # any


def test_json_shows_why_cuda_is_not_available_here(capsys):
    from octavo_cuda.plugin import probe_cuda

    answer = probe_cuda()
    cuda = {row["name"]: row for row in _json(capsys)["backends"]}["cuda"]
    assert (cuda["available"], cuda["reason"]) == (answer.available, answer.reason)
    assert cuda["package"] == "octavo-backend-cuda" and cuda["priority"] == 100
    assert cuda["capabilities"]["cuda_graphs"] is True
    assert cuda["capabilities"]["cuda_graphs_multi_token"] is True
    assert cuda["capabilities"]["async_scheduling"] is True
    assert cuda["capabilities"]["default_max_num_batched_tokens"] == 8192
    assert cuda["capabilities"]["head_dims"] == [64, 80, 96, 128, 256]


def test_text_lists_each_backend_with_its_capabilities(with_restricted, capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    block = out.split("\nrestricted ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert block[0].split() == ["available", *restricted_backend.REASON.split()]
    details = [line.strip() for line in block[1:]]
    assert details[:3] == [
        "test backend with tight declared limits",
        "package octavo-test-restricted, priority -10, device type cpu, process group gloo",
        "split models here (mp executor): one process per rank; more hosts with "
        "--distributed-executor-backend ray",
    ]
    assert details[3:] == [
        "dtypes             float32", "head dims          16, 64", "block sizes        16",
        "CUDA graphs        no", "multi-token graphs no", "async scheduling   no",
        "token budget       2048", "max num seqs       8", "max model len      128",
        "prompt logprobs    no", "max top logprobs   2", "quantization       none",
        "kv cache dtypes    auto", "sliding window     no", "logits soft cap    no",
    ]
    cpu = out.split("\ncpu ", 1)[1].split("\n\n", 1)[0]
    assert "head dims          any" in cpu and "max num seqs       no limit" in cpu
    default = select_backend(octavo.plugins.get_plugin_manager()).name  # cpu without a GPU
    (marked,) = [line for line in out.splitlines() if line.endswith("<- default")]
    assert marked.startswith(f"{default} ")
    assert out.rstrip().endswith(
        f"Default: {default} (the available backend of highest priority); choose another with "
        "--device NAME.")


class _Unavailable:
    @hookimpl
    def octavo_register_backends(self, register):
        register(Backend(name="fakegpu", device_type="cuda", priority=50, package="fake-gpu",
                         is_available=lambda: Availability(False, "driver 0.1 is too old")))


def test_nothing_available_exits_1_with_the_reason_and_what_to_install(monkeypatch, capsys):
    pm = build_plugin_manager(load_entry_points=False)
    pm.register(_Unavailable(), name="fake")
    monkeypatch.setattr(octavo.plugins, "_default_pm", pm)
    assert main(["backends"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("fakegpu  unavailable  driver 0.1 is too old\n")
    assert "No installed backend can run on this machine. Install one that does, e.g. " \
           "octavo-backend-cpu (pip install ./backends/cpu)" in out
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["default"] is None and data["backends"][0]["default"] is False


def test_generate_on_an_unavailable_backend_says_why(tiny_llama, capsys):
    from octavo_cuda.plugin import probe_cuda

    answer = probe_cuda()
    if answer.available:
        pytest.skip(f"CUDA is available here ({answer.reason}); this checks a machine without")
    code = main(["generate", "hi", "--model", str(tiny_llama), "--device", "cuda"])
    assert code == 1
    err = capsys.readouterr().err
    assert ("octavo generate: error: Backend 'cuda' is installed but not available here: "
            f"{answer.reason}") in err


def test_a_plugin_found_through_its_entry_point_is_listed(tmp_path):
    """The restricted backend as an installed plugin (a dist-info on PYTHONPATH) in a real
    ``octavo backends`` process: what the OpenAI-server tests rely on."""
    restricted_backend.write_entry_point(tmp_path)
    path = os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OCTAVO_LOG_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, "-m", "octavo.cli.main", "backends", "--json"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)["backends"]}
    assert rows["restricted"]["capabilities"]["max_logprobs"] == 2
    assert "cpu" in rows
