"""Backend selection: ``--device NAME`` or the available backend of highest priority, and the
errors that say what to install when nothing can run."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import octavo
import octavo.plugins
import pytest
from octavo.backends import (
    Availability,
    Backend,
    BackendNotAvailableError,
    list_backends,
    select_backend,
)
from octavo.backends.selection import probe
from octavo.hookspecs import hookimpl
from octavo.plugins import ENTRY_POINT_GROUP, build_plugin_manager

from tests.helpers.imports import modules_loaded_by

REPO = Path(__file__).resolve().parents[2]


def _backend(name: str, priority: int, available: bool = True, reason: str = "ok") -> Backend:
    return Backend(name=name, device_type="cpu", priority=priority, package=f"octavo-backend-{name}",
                   is_available=lambda: Availability(available, reason))


class FakeBackendsPlugin:
    """Registers the given backends through ``octavo_register_backends``."""

    def __init__(self, *backends: Backend) -> None:
        self.backends = backends

    @hookimpl
    def octavo_register_backends(self, register):
        for backend in self.backends:
            register(backend)


def _manager(*backends: Backend, with_cpu: bool = False):
    """A fresh manager holding only fake backends (and the real CPU backend if asked).

    Other installed backends stay out, so the answers do not depend on the machine's GPUs.
    """
    pm = build_plugin_manager(load_entry_points=False)
    if with_cpu:
        import octavo_cpu.plugin

        pm.register(octavo_cpu.plugin.plugin, name="cpu")
    pm.register(FakeBackendsPlugin(*backends), name="fake-backends")
    pm.check_pending()
    return pm


@pytest.fixture
def no_backends(monkeypatch):
    """The process-wide manager rebuilt with every entry point disabled."""
    monkeypatch.setenv("OCTAVO_PLUGINS", "")
    monkeypatch.setattr(octavo.plugins, "_default_pm", build_plugin_manager())
    return octavo.plugins.get_plugin_manager()


def test_none_installed_says_which_package_to_install(monkeypatch):
    # Every installed plugin blocked (backends and plugins such as the template accelerator).
    installed = [ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    monkeypatch.setenv("OCTAVO_DISABLE_PLUGINS", ",".join(installed))
    pm = build_plugin_manager()
    assert list_backends(pm) == []
    with pytest.raises(BackendNotAvailableError) as info:
        select_backend(pm)
    message = str(info.value)
    assert "octavo-backend-cpu" in message and "pip install ./backends/cpu" in message
    assert "octavo backends" in message


def test_llm_without_a_backend_fails_with_that_message(no_backends, tiny_llama):
    assert list_backends(no_backends) == []
    with pytest.raises(BackendNotAvailableError, match=r"octavo-backend-cpu \(pip install"):
        octavo.LLM(str(tiny_llama))


def test_installed_but_unavailable_hints_at_a_backend_that_runs():
    pm = _manager(_backend("cuda", 100, available=False, reason="no CUDA device is visible"))
    with pytest.raises(BackendNotAvailableError) as info:
        select_backend(pm)
    message = str(info.value)
    assert "cuda: no CUDA device is visible" in message
    assert "octavo-backend-cpu (pip install ./backends/cpu)" in message
    assert "octavo-backend-cuda" not in message.split("Install", 1)[1]  # already installed


def test_unknown_device_names_the_installed_backends():
    pm = _manager(_backend("alpha", 1), _backend("beta", 2))
    with pytest.raises(BackendNotAvailableError, match=r"'nosuch' is not installed.*\['alpha', 'beta'\]"):
        select_backend(pm, "nosuch")
    with pytest.raises(BackendNotAvailableError, match=r"Install octavo-backend-rocm"):
        select_backend(pm, "rocm")  # one of ours: say which package provides it


def test_named_unavailable_backend_gives_its_reason():
    pm = _manager(_backend("fakedev", 50, available=False, reason="fakedev driver 0.0 too old"),
                  with_cpu=True)
    with pytest.raises(BackendNotAvailableError,
                       match="'fakedev' is installed but not available here: fakedev driver 0.0"):
        select_backend(pm, "fakedev")
    assert select_backend(pm).name == "cpu"  # an unavailable backend is skipped by default


def test_default_is_the_available_backend_of_highest_priority():
    pm = _manager(_backend("slow", 10), _backend("fast", 90),
                  _backend("fastest", 99, available=False), with_cpu=True)
    assert [b.name for b in list_backends(pm)][:3] == ["fastest", "fast", "slow"]
    assert select_backend(pm).name == "fast"
    assert select_backend(pm, "slow").name == "slow"  # --device wins over priority
    assert select_backend(pm, "cpu").name == "cpu"


def test_a_crashing_probe_is_an_unavailable_backend():
    def crash() -> Availability:
        raise OSError("driver exploded")

    broken = Backend(name="broken", device_type="x", priority=5, package="p", is_available=crash)
    answer = probe(broken)
    assert not answer.available and "driver exploded" in answer.reason
    pm = _manager(broken, _backend("ok", 1))
    assert select_backend(pm).name == "ok"


def test_register_checks_what_it_is_given():
    pm = _manager(_backend("twin", 1), _backend("twin", 2))
    with pytest.raises(ValueError, match="two plugins register a backend named 'twin'"):
        list_backends(pm)

    class NotABackend:
        @hookimpl
        def octavo_register_backends(self, register):
            register({"name": "dict"})

    pm = build_plugin_manager(load_entry_points=False)
    pm.register(NotABackend())
    with pytest.raises(TypeError, match="must register Backend objects"):
        list_backends(pm)


def test_an_available_backend_without_a_worker_fails_clearly(tiny_llama, monkeypatch):
    """A backend that registers itself but implements no selection hook."""
    pm = _manager(_backend("fakedev", 1000), with_cpu=True)
    monkeypatch.setattr(octavo.plugins, "_default_pm", pm)
    with pytest.raises(RuntimeError, match="'fakedev' provides no worker class"):
        octavo.LLM(str(tiny_llama), num_gpu_blocks_override=16)  # fakedev wins by priority


def test_the_core_never_imports_a_backend_package():
    setup = (
        "import os; os.environ['OCTAVO_PLUGINS'] = ''\n"
        "import octavo, octavo.hookspecs, octavo.plugins, octavo.backends, octavo.cli.main\n"
        "octavo.backends.list_backends(octavo.plugins.build_plugin_manager())\n"
    )
    assert modules_loaded_by(setup, ("octavo_cpu", "octavo_cuda", "octavo_rocm")) == []
    # And no source file of the core imports one (install hints in strings are fine).
    pattern = re.compile(r"^\s*(from|import)\s+octavo_(cpu|cuda|rocm)\b", re.MULTILINE)
    offenders = [str(p) for p in (REPO / "core" / "src").rglob("*.py")
                 if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
