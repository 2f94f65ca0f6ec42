"""The core's packages form layers, and no import runs from a lower layer to a higher one.

Every ``import`` of an ``octavo`` module in ``core/src/octavo`` is read with ``ast`` (those
inside functions too: they run when the function does); imports under ``if TYPE_CHECKING:``
are for annotations only and never run, so they are left out. The step messages are a leaf
everyone may import (``octavo.messages``); the front end (``octavo.engine``) sits above the
engine core, which sits above the scheduler and the executor, and so on down.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "core" / "src" / "octavo"

# Lowest first; a module may import its own layer and those below it.
LAYERS: list[set[str]] = [
    {"version", "envs", "logger", "errors", "sampling_params", "lora_request", "outputs",
     "transfer"},
    {"messages"},
    {"backends", "hookspecs", "plugins"},
    {"config", "reasoning"},
    {"attention", "kernels", "sample", "kv_cache", "distributed", "spec_decode"},
    {"model_executor", "transformers_utils", "lora"},
    {"worker", "scheduler", "structured_output"},
    {"executor"},
    {"engine_core"},
    {"engine"},
    {"entrypoints", "cli", "benchmarks", "testing", "__init__"},
]


def _layer_of(module: str) -> int:
    """Layer of ``octavo.<top>...`` (or of a file's own top-level name)."""
    top = module.split(".")[1] if module.startswith("octavo.") else module
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its package is in no layer of tests/test_layers.py")


def _runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every ``octavo`` import that can run (not under TYPE_CHECKING)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.startswith("octavo.")]
    return found


def test_every_package_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    for top in sorted(tops):
        _layer_of(top)


def test_no_import_runs_upward():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0].removesuffix(".py")
        own_layer = _layer_of(own)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, module in _runtime_imports(tree):
            if _layer_of(module) > own_layer:
                upward.append(f"{relative}:{line} imports {module}")
    assert upward == []


def test_the_messages_import_no_layer_above_them():
    """The leaf the issue asked for: messages import only the foundation."""
    for path in sorted((PACKAGE / "messages").rglob("*.py")):
        for line, module in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            assert _layer_of(module) <= _layer_of("messages"), f"{path.name}:{line} {module}"
