"""The documentation matches the code: hooks, CLI flags, environment variables, module names,
and the example backend of docs/writing-a-backend.md actually runs.

Changing a hook spec, a CLI flag or an env var without updating docs/ fails here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import sys
import tomllib
from pathlib import Path

import octavo
import pytest
from octavo import SamplingParams, envs
from octavo.cli.main import build_parser, main
from octavo.plugins import get_plugin_manager
from octavo.version import __version__

from tests.test_hookspecs import SPECS

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BACKEND_DOC = (DOCS / "writing-a-backend.md").read_text(encoding="utf-8")
CLI_DOC = (DOCS / "cli.md").read_text(encoding="utf-8")
ALL_DOCS = {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}


def sections(text: str, level: str) -> dict[str, str]:
    """Heading text -> body, for headings of exactly ``level`` (e.g. "###")."""
    parts = re.split(rf"^{level} (.+)$", text, flags=re.MULTILINE)
    end = re.compile(rf"^#{{1,{len(level)}}} ", flags=re.MULTILINE)  # same or higher level
    return {parts[i].strip(): end.split(parts[i + 1])[0] for i in range(1, len(parts), 2)}


# ---- hooks ------------------------------------------------------------------------------------


def documented_hooks() -> dict[str, tuple[list[str], str]]:
    """Hook name -> (parameters in the heading, section body) from writing-a-backend.md."""
    hooks = {}
    for heading, body in sections(BACKEND_DOC, "###").items():
        match = re.fullmatch(r"`(octavo_\w+)\(([^)]*)\)`", heading)
        if match:
            params = [p.strip() for p in match.group(2).split(",") if p.strip()]
            hooks[match.group(1)] = (params, body)
    return hooks


def test_every_hook_is_documented_and_nothing_else():
    assert sorted(documented_hooks()) == sorted(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_documentation_matches_the_spec(name):
    fn, opts = SPECS[name]
    params, body = documented_hooks()[name]
    spec_params = list(inspect.signature(fn).parameters)
    assert params == spec_params, f"{name}: doc heading says {params}, spec has {spec_params}"
    listed = re.findall(r"^\s+- `(\w+)`:", body, flags=re.MULTILINE)
    assert listed == spec_params, f"{name}: parameter list {listed} != spec {spec_params}"
    for field in ("**Kind:**", "**Called:**", "**Parameters:**", "**Returns:**"):
        assert field in body, f"{name}: section lacks {field}"
    kind = re.search(r"\*\*Kind:\*\* ([^\n(]+)", body).group(1).strip().rstrip(".")
    if opts.get("firstresult"):
        assert kind == "firstresult", f"{name} is firstresult in the spec"
        assert "**`None` means:**" in body
    else:
        assert kind == "all results", f"{name} calls every implementation"


# ---- CLI --------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """"generate" / "bench throughput" / ... -> the parser of that command."""
    commands = {}
    for name, parser in _subparsers(build_parser()).items():
        modes = _subparsers(parser)
        if modes:
            commands.update({f"{name} {mode}": sub for mode, sub in modes.items()})
        else:
            commands[name] = parser
    return commands


def _long_options(parser: argparse.ArgumentParser, group_title: str | None = None) -> set[str]:
    groups = [g for g in parser._action_groups if group_title in (None, g.title)]
    return {o for g in groups for a in g._group_actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_every_cli_flag_is_documented(command):
    doc_sections = sections(CLI_DOC, "##")
    assert f"`octavo {command}`" in doc_sections, f"docs/cli.md has no section for {command}"
    body = doc_sections[f"`octavo {command}`"]
    parser = cli_commands()[command]
    engine = _long_options(parser, "engine options")
    for option in sorted(_long_options(parser) - engine):
        assert re.search(rf"`{option}[ `]", body), f"{command}: {option} is not documented"
    engine_doc = doc_sections["Engine options"]
    for option in sorted(engine):
        assert re.search(rf"`{option}[ `]", engine_doc), f"engine option {option} not documented"
    if engine:
        assert "[engine option](#engine-options)" in body


def test_cli_doc_lists_no_flag_that_does_not_exist():
    real = set().union(*(_long_options(p) for p in cli_commands().values()))
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", CLI_DOC))
    assert documented - real == set()


# ---- environment variables, names, paths -------------------------------------------------------


def test_every_env_var_is_documented():
    names = set(re.findall(r"OCTAVO_[A-Z0-9_]+", inspect.getsource(envs)))
    assert {"OCTAVO_PLUGINS", "OCTAVO_DISABLE_PLUGINS", "OCTAVO_TRACE_HOOKS"} <= names
    for name in sorted(names):
        assert f"`{name}`" in BACKEND_DOC, f"{name} is not documented in writing-a-backend.md"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(module_name)
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


# Dotted names in the docs that are loggers, not modules.
LOGGER_NAMES = {"octavo.hooks"}


@pytest.mark.parametrize("doc", sorted(ALL_DOCS))
def test_names_and_paths_in_docs_exist(doc):
    text = ALL_DOCS[doc]
    dotted = set(re.findall(r"`(octavo(?:\.\w+)+)", text)) - LOGGER_NAMES
    assert dotted, doc
    assert [d for d in sorted(dotted) if not _resolves(d)] == []
    paths = set(re.findall(r"`((?:core|backends|tests|docs)/[\w./-]+)`", text))
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []


# ---- the example backend runs -----------------------------------------------------------------


def example_files(prefix: str) -> dict[str, str]:
    """``{"octavo_mydev/plugin.py": source, ...}`` from the doc's python blocks."""
    blocks = re.findall(rf"```python\n# ({prefix}/\w+\.py)[^\n]*\n(.*?)```", BACKEND_DOC,
                        flags=re.DOTALL)
    return dict(blocks)


def test_example_pyproject_pins_the_core_and_registers_the_entry_point():
    block = re.search(r"```toml\n# pyproject.toml\n(.*?)```", BACKEND_DOC, flags=re.DOTALL)
    project = tomllib.loads(block.group(1))
    assert project["project"]["entry-points"]["octavo"] == {"mydev": "octavo_mydev.plugin:plugin"}
    assert f"octavo-core=={__version__}" in project["project"]["dependencies"]
    real = tomllib.loads((REPO / "backends" / "cpu" / "pyproject.toml").read_text())
    assert f"octavo-core=={__version__}" in real["project"]["dependencies"]


@pytest.fixture
def example_package(tmp_path, monkeypatch):
    """Writes a doc example package to disk, imports its plugin and registers it on the
    engine's plugin manager; undone when the test ends."""
    pm = get_plugin_manager()
    registered: list[str] = []

    def install(prefix: str):
        files = example_files(prefix)
        assert f"{prefix}/plugin.py" in files
        for path, source in files.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(source)
            (tmp_path / prefix / "__init__.py").touch()
        monkeypatch.syspath_prepend(str(tmp_path))
        module = importlib.import_module(f"{prefix}.plugin")
        plugin = getattr(module, "plugin", module)  # a BackendPlugin, or a module of hooks
        registered.append(pm.register(plugin, name=prefix))
        pm.check_pending()
        return plugin

    try:
        yield install
    finally:
        for name in registered:
            pm.unregister(name=name)
        for module in [m for m in sys.modules if m.startswith(("octavo_mydev", "octavo_fastcpu"))]:
            del sys.modules[module]


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["Hello world", "The capital of France is"]


def _ids(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_example_backend_from_the_doc_runs(example_package, tiny_llama, capsys):
    example_package("octavo_mydev")
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["backends"]}
    assert rows["mydev"]["available"] and rows["mydev"]["reason"] == "mydev emulated on the host"
    llm = octavo.LLM(str(tiny_llama), device="mydev")  # sized by the example's memory hook
    worker = llm.llm_engine.engine_core.executor.worker
    assert type(worker).__name__ == "MyDevWorker"
    assert worker.model_runner.attn_backend.name == "mydev-reference"
    assert llm.llm_engine.num_blocks == 64 * 2**20 // worker.kv_cache_bytes_per_block()
    reference = octavo.LLM(str(tiny_llama), device="cpu", num_gpu_blocks_override=64)
    assert _ids(llm) == _ids(reference)


def test_example_override_from_the_doc_replaces_only_cpu_attention(example_package, tiny_llama):
    example_package("octavo_fastcpu")
    llm = octavo.LLM(str(tiny_llama), device="cpu", num_gpu_blocks_override=64)
    worker = llm.llm_engine.engine_core.executor.worker
    assert worker.model_runner.attn_backend.name == "fast-cpu"
    assert type(worker).__name__ == "CPUWorker"  # the rest still comes from the CPU backend
    assert len(_ids(llm)) == len(PROMPTS)
