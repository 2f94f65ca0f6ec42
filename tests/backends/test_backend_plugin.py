"""``BackendPlugin``: one declaration gives a backend its four hooks, lazily imported."""

from __future__ import annotations

import sys
import types

import pytest
from octavo.backends.backend import Availability, Backend
from octavo.backends.plugin import BackendPlugin, import_reference
from octavo.config import CacheConfig, ParallelConfig
from octavo.plugins import build_plugin_manager
from octavo.worker.worker import Worker


class _Worker(Worker):
    pass


@pytest.fixture
def pieces(monkeypatch):
    """A module of backend pieces, importable as ``fake_pieces``; counts what was called."""
    module = types.ModuleType("fake_pieces")
    module.calls = []
    module.Worker = _Worker

    def attention(model_config, cache_config):
        module.calls.append(("attention", model_config, cache_config))
        return "attention-backend"

    def memory(worker, cache_config):
        module.calls.append(("memory", worker, cache_config))
        return 1234

    module.attention = attention
    module.memory = memory
    monkeypatch.setitem(sys.modules, "fake_pieces", module)
    return module


def _plugin(name: str = "fakedev") -> BackendPlugin:
    backend = Backend(name=name, device_type="cpu", priority=1, package="fake",
                      is_available=lambda: Availability(True, "here"))
    return BackendPlugin(backend, attention="fake_pieces:attention", worker="fake_pieces:Worker",
                         kv_cache_memory="fake_pieces:memory")


def test_hooks_answer_for_their_backend_only(pieces):
    plugin = _plugin()
    cache = CacheConfig()
    assert plugin.octavo_attention_backend(backend="fakedev", model_config="mc",
                                           cache_config=cache) == "attention-backend"
    worker_cls = plugin.octavo_worker_class(backend="fakedev", parallel_config=ParallelConfig())
    assert worker_cls is _Worker
    assert plugin.octavo_available_kv_cache_memory(backend="fakedev", worker="w",
                                                   cache_config=cache) == 1234
    assert pieces.calls == [("attention", "mc", cache), ("memory", "w", cache)]
    assert plugin.octavo_attention_backend(backend="cpu", model_config=None,
                                           cache_config=cache) is None
    assert plugin.octavo_worker_class(backend="cpu", parallel_config=None) is None
    assert plugin.octavo_available_kv_cache_memory(backend="cpu", worker=None,
                                                   cache_config=cache) is None
    assert len(pieces.calls) == 2  # nothing imported or called for another backend


def test_registered_with_pluggy_like_a_module(pieces):
    pm = build_plugin_manager(load_entry_points=False)
    pm.register(_plugin(), name="fakedev")
    pm.check_pending()  # the methods are valid hook implementations
    registered = []
    pm.hook.octavo_register_backends(register=registered.append)
    assert [b.name for b in registered] == ["fakedev"]
    assert pm.hook.octavo_worker_class(backend="fakedev", parallel_config=None) is _Worker
    assert pm.hook.octavo_worker_class(backend="other", parallel_config=None) is None


def test_a_bad_reference_is_refused_at_declaration():
    backend = _plugin().backend
    with pytest.raises(ValueError, match="worker must be a 'module:attribute' reference"):
        BackendPlugin(backend, attention="a:b", worker="fake_pieces.Worker", kv_cache_memory="a:b")


def test_import_reference_errors_say_what_is_missing(pieces):
    assert import_reference("fake_pieces:Worker") is _Worker
    with pytest.raises(ImportError, match="'fake_pieces' has no attribute 'Nope'"):
        import_reference("fake_pieces:Nope")
    with pytest.raises(ModuleNotFoundError):
        import_reference("no_such_module_here:x")


@pytest.mark.parametrize("name", ["cpu", "cuda", "rocm"])
def test_real_backends_are_declarations(name):
    module = pytest.importorskip(f"octavo_{name}.plugin")
    assert isinstance(module.plugin, BackendPlugin) and module.plugin.backend.name == name
    # Every reference resolves (imports torch and the kernels: done here, not at discovery).
    for reference in (module.plugin.attention, module.plugin.worker, module.plugin.kv_cache_memory):
        assert callable(import_reference(reference)), reference
    assert issubclass(import_reference(module.plugin.worker), Worker)
