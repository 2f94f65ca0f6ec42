"""``docs/serving.md``: its examples run against a real server; every flag and metric is listed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from octavo.entrypoints.openai.metrics import METRICS

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME

DOC = Path(__file__).parents[3] / "docs" / "serving.md"
EXAMPLE = re.compile(r"```(bash|python) example\n(.*?)```", re.DOTALL)


def examples(language: str) -> list[str]:
    return [code for lang, code in EXAMPLE.findall(DOC.read_text()) if lang == language]


def adapt(code: str, server) -> str:
    """Point an example at the test server (URL, key, model name)."""
    return (code.replace("http://localhost:8000", server.url)
            .replace("token-abc123", API_KEY)
            .replace('"smollm2"', f'"{SERVED_NAME}"'))


def test_docs_have_examples() -> None:
    assert len(examples("bash")) >= 4 and len(examples("python")) >= 2


@pytest.mark.parametrize("index", range(len(examples("bash"))))
def test_curl_example(server, index: int) -> None:
    code = adapt(examples("bash")[index], server)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert '"error"' not in out, out
    for line in out.splitlines():
        if line.startswith("data: {"):
            json.loads(line[6:])
    assert out.strip()


@pytest.mark.parametrize("index", range(len(examples("python"))))
def test_python_example(server, index: int) -> None:
    code = adapt(examples("python")[index], server)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_every_flag_and_metric_is_documented() -> None:
    from octavo.cli.main import build_parser

    doc = DOC.read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}" in doc, f"{flag} is not documented in {DOC.name}"
    for name, kind, _ in METRICS:
        shown = f"octavo:{name}_total" if kind == "counter" else f"octavo:{name}"
        assert f"`{shown}`" in doc, f"metric {shown} is not documented"
