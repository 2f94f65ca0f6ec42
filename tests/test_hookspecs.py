"""The hook specs themselves: documented, consistently shaped, and each exercised by a test.

``tests/test_docs.py`` checks that docs/writing-a-backend.md documents the same hooks with the
same parameters; this file checks the specs' own contract and that every hook has a test.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pluggy
import pytest
from octavo import hookspecs

TESTS = Path(__file__).resolve().parent


def hook_specs() -> dict[str, tuple[object, dict]]:
    """name -> (spec function, pluggy spec options) for every hook in ``octavo.hookspecs``."""
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return {name: (fn, getattr(fn, marker)) for name, fn in vars(hookspecs).items()
            if inspect.isfunction(fn) and hasattr(fn, marker)}


SPECS = hook_specs()
# Selection hooks get the chosen backend name first and stop at the first non-None result.
SELECTION_HOOKS = sorted(name for name, (_, opts) in SPECS.items() if opts.get("firstresult"))
CONTRIBUTION_HOOKS = sorted(set(SPECS) - set(SELECTION_HOOKS))


def test_the_surface_is_what_we_think_it_is():
    assert SELECTION_HOOKS == [
        "octavo_attention_backend", "octavo_available_kv_cache_memory", "octavo_kv_block_mover",
        "octavo_quant_kernels", "octavo_worker_class"]
    assert CONTRIBUTION_HOOKS == [
        "octavo_register_backends", "octavo_register_logits_processors", "octavo_register_models",
        "octavo_register_quantization_methods", "octavo_register_reasoning_parsers",
        "octavo_register_routes", "octavo_register_tool_parsers"]


def test_plugin_manager_knows_exactly_these_hooks():
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    assert sorted(h for h in dir(pm.hook) if h.startswith("octavo_")) == sorted(SPECS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_is_documented_like_a_contract(name):
    fn, opts = SPECS[name]
    doc = inspect.getdoc(fn) or ""
    params = list(inspect.signature(fn).parameters)
    assert name.startswith("octavo_")
    assert "Called" in doc, f"{name}: say when (and in which process) it is called"
    for param in params:
        assert f":param {param}:" in doc, f"{name}: parameter {param!r} is not documented"
    documented = re.findall(r":param (\w+):", doc)
    assert documented == params, f"{name}: documented params {documented} != signature {params}"
    for param in params:
        assert inspect.signature(fn).parameters[param].annotation is not inspect.Parameter.empty
    if opts.get("firstresult"):
        assert params[0] == "backend", f"{name}: selection hooks take the backend name first"
        assert "Stops at the first non-``None`` result" in doc
        assert "``None`` if ``backend`` is not" in doc
    else:
        assert params == ["register"], f"{name}: contribution hooks take one register callback"


def _test_sources() -> dict[Path, str]:
    """Every test module except the surface checks themselves."""
    skip = {TESTS / "test_hookspecs.py", TESTS / "test_docs.py"}
    return {p: p.read_text(encoding="utf-8") for p in TESTS.rglob("*.py") if p not in skip}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hook_has_a_test(name):
    """Like datasette's ``_have_tests``: some test outside this file uses the hook by name."""
    users = [p.relative_to(TESTS) for p, text in _test_sources().items()
             if re.search(rf"\b{name}\b", text)]
    assert users, f"no test under tests/ exercises {name}"
