"""The plugin manager and every hook, end to end through ``octavo.LLM`` on a tiny model.

Plugins are registered in fixtures on the process-wide manager the engine uses
(``octavo.plugins.get_plugin_manager()``) and unregistered in ``finally``, so no test leaks a
plugin into another.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
from pathlib import Path

import octavo
import pluggy
import pytest
from octavo import SamplingParams
from octavo.attention.reference import ReferenceAttentionBackend, ReferenceAttentionImpl
from octavo.hookspecs import hookimpl
from octavo.model_executor.models.llama import LlamaForCausalLM
from octavo.plugins import ENTRY_POINT_GROUP, build_plugin_manager, get_plugin_manager
from octavo.worker.worker import Worker

# Octavo's own plugin modules, registered before any installed plugin.
BUILTIN_PLUGINS = (
    "octavo.model_executor.models.builtin_plugin",
    "octavo.model_executor.layers.quantization.builtin_plugin",
    "octavo.sample.builtin_logits_processors",
    "octavo.reasoning.builtin_plugin",
    "octavo.entrypoints.openai.tool_parsers.builtin_plugin",
)

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(model_dir, **kwargs):
    """The engine on the CPU backend (named, so a GPU machine does not pick CUDA)."""
    return octavo.LLM(str(model_dir), device="cpu", **kwargs)


def _token_ids(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def register_plugin():
    """``register(plugin)`` on the engine's plugin manager; unregistered when the test ends."""
    pm = get_plugin_manager()
    names: list[str] = []

    def register(plugin, name: str | None = None):
        names.append(pm.register(plugin, name=name or f"test-plugin-{len(names)}"))
        pm.check_pending()
        return plugin

    try:
        yield register
    finally:
        for name in names:
            pm.unregister(name=name)


@pytest.fixture
def octavo_logs(monkeypatch, caplog):
    """caplog that sees the ``octavo`` tree (``configure_logging`` stops propagation)."""
    monkeypatch.setattr(logging.getLogger("octavo"), "propagate", True)
    return caplog


@pytest.fixture(scope="module")
def default_token_ids(tiny_llama):
    """Greedy ids of the tiny model with the plain CPU backend (no test plugin)."""
    return _token_ids(_llm(tiny_llama, num_gpu_blocks_override=64))


# ---- loading ---------------------------------------------------------------------------------


def test_installed_cpu_backend_is_loaded_from_its_entry_point():
    names = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert "cpu" in names
    pm = build_plugin_manager()
    import octavo_cpu.plugin

    assert pm.get_plugin("cpu") is octavo_cpu.plugin.plugin
    assert pm.get_plugin("octavo.model_executor.models.builtin_plugin") is not None
    assert get_plugin_manager() is get_plugin_manager()  # one manager per process


def test_check_pending_rejects_a_misspelled_hook():
    class Misspelled:
        @hookimpl
        def octavo_atention_backend(self, backend, model_config, cache_config):
            return None

    pm = build_plugin_manager(load_entry_points=False)
    pm.register(Misspelled(), name="misspelled")
    with pytest.raises(pluggy.PluginValidationError, match="octavo_atention_backend"):
        pm.check_pending()


def test_check_pending_rejects_an_unknown_parameter():
    class WrongArgs:
        @hookimpl
        def octavo_worker_class(self, backend, parallel_config, device):
            return None

    pm = build_plugin_manager(load_entry_points=False)
    with pytest.raises(pluggy.PluginValidationError, match="device"):
        pm.register(WrongArgs(), name="wrong-args")


class _BrokenEntryPoint:
    """Looks like an ``importlib.metadata.EntryPoint`` whose module fails to import."""

    name, value, group, dist = "broken", "octavo_broken.plugin", ENTRY_POINT_GROUP, None

    def load(self):
        raise ImportError("No module named 'octavo_broken'")


def test_a_broken_entry_point_names_itself_and_the_way_around(monkeypatch):
    real = importlib.metadata.entry_points

    def entry_points(group):
        return [*real(group=group), _BrokenEntryPoint()]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    with pytest.raises(RuntimeError, match="'broken'.*OCTAVO_DISABLE_PLUGINS=broken"):
        build_plugin_manager()
    monkeypatch.setenv("OCTAVO_DISABLE_PLUGINS", "broken")
    assert build_plugin_manager().get_plugin("cpu") is not None


def test_allow_list_and_block_list(monkeypatch):
    monkeypatch.setenv("OCTAVO_PLUGINS", "cpu")
    pm = build_plugin_manager()
    assert pm.get_plugin("cpu") is not None
    assert all(name in ("cpu", *BUILTIN_PLUGINS) for name, _ in pm.list_name_plugin())
    monkeypatch.setenv("OCTAVO_PLUGINS", "")  # empty allow-list: no entry point at all
    pm = build_plugin_manager()
    assert [name for name, _ in pm.list_name_plugin()] == list(BUILTIN_PLUGINS)
    monkeypatch.delenv("OCTAVO_PLUGINS")
    monkeypatch.setenv("OCTAVO_DISABLE_PLUGINS", " cpu , nosuch")
    pm = build_plugin_manager()
    assert pm.get_plugin("cpu") is None
    assert pm.get_plugin("octavo.model_executor.models.builtin_plugin") is not None


def test_trace_hooks_logs_calls_and_results(monkeypatch, octavo_logs):
    monkeypatch.setenv("OCTAVO_TRACE_HOOKS", "1")
    pm = build_plugin_manager()
    with octavo_logs.at_level(logging.DEBUG, logger="octavo.hooks"):
        pm.hook.octavo_worker_class(backend="cpu", parallel_config=None)
    messages = [r.getMessage() for r in octavo_logs.records if r.name == "octavo.hooks"]
    assert any(m.startswith("call octavo_worker_class(backend, parallel_config)") and "cpu" in m
               for m in messages), messages
    assert any("octavo_worker_class -> <class 'octavo_cpu.worker.CPUWorker'>" in m
               for m in messages), messages


def test_no_tracing_by_default(monkeypatch, octavo_logs):
    monkeypatch.delenv("OCTAVO_TRACE_HOOKS", raising=False)
    pm = build_plugin_manager()
    with octavo_logs.at_level(logging.DEBUG, logger="octavo.hooks"):
        pm.hook.octavo_worker_class(backend="cpu", parallel_config=None)
    assert not [r for r in octavo_logs.records if r.name == "octavo.hooks"]


# ---- overriding one piece of the CPU backend with tryfirst -----------------------------------


class CountingAttention(ReferenceAttentionBackend):
    """The reference kernels, counting layer calls: a stand-in for a faster CPU kernel."""

    name = "counting-reference"

    def __init__(self) -> None:
        self.num_calls = 0

    def make_impl(self, num_heads, num_kv_heads, head_dim, scale):
        backend = self

        class Impl(ReferenceAttentionImpl):
            def forward(self, *args, **kwargs):
                backend.num_calls += 1
                return super().forward(*args, **kwargs)

        return Impl(num_heads, num_kv_heads, head_dim, scale)


class FasterCPUAttentionPlugin:
    """What a separately installed plugin does to replace the CPU attention kernel."""

    def __init__(self) -> None:
        self.attention = CountingAttention()

    @hookimpl(tryfirst=True)
    def octavo_attention_backend(self, backend, model_config, cache_config):
        return self.attention if backend == "cpu" else None


def test_tryfirst_attention_override_replaces_cpu_kernel(tiny_llama, register_plugin,
                                                         default_token_ids):
    plugin = register_plugin(FasterCPUAttentionPlugin())
    llm = _llm(tiny_llama, num_gpu_blocks_override=64)
    worker = llm.llm_engine.engine_core.executor.worker
    assert worker.model_runner.attn_backend is plugin.attention
    assert plugin.attention.num_calls == 0
    assert _token_ids(llm) == default_token_ids
    assert plugin.attention.num_calls > 0


def test_override_for_another_backend_leaves_cpu_alone(tiny_llama, register_plugin):
    class CudaOnly:
        @hookimpl(tryfirst=True)
        def octavo_attention_backend(self, backend, model_config, cache_config):
            return CountingAttention() if backend == "cuda" else None

    register_plugin(CudaOnly())
    llm = _llm(tiny_llama, num_gpu_blocks_override=64)
    assert llm.llm_engine.engine_core.executor.worker.model_runner.attn_backend.name == "cpu-torch"


# ---- octavo_register_models -------------------------------------------------------------------


class MyLlamaForCausalLM(LlamaForCausalLM):
    """A plugin's architecture: Llama under another name, counting forwards."""

    num_forwards = 0

    def forward(self, *args, **kwargs):
        MyLlamaForCausalLM.num_forwards += 1
        return super().forward(*args, **kwargs)


class MyModelsPlugin:
    @hookimpl
    def octavo_register_models(self, register):
        register("MyLlamaForCausalLM", MyLlamaForCausalLM)


@pytest.fixture(scope="module")
def my_llama_dir(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama whose config.json names the plugin's architecture."""
    folder = tmp_path_factory.mktemp("my-llama") / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_unknown_architecture_error_points_at_the_hook(my_llama_dir):
    with pytest.raises(ValueError, match="MyLlamaForCausalLM.*octavo_register_models"):
        _llm(my_llama_dir, num_gpu_blocks_override=64)


def test_register_models_adds_an_architecture(my_llama_dir, register_plugin, default_token_ids):
    register_plugin(MyModelsPlugin())
    llm = _llm(my_llama_dir, num_gpu_blocks_override=64)
    assert type(llm.llm_engine.engine_core.executor.worker.model) is MyLlamaForCausalLM
    before = MyLlamaForCausalLM.num_forwards
    assert _token_ids(llm) == default_token_ids  # same weights, same tokens
    assert MyLlamaForCausalLM.num_forwards > before


def test_register_models_can_replace_a_builtin_architecture(tiny_llama, register_plugin,
                                                           default_token_ids, octavo_logs):
    """The built-in hook implementation is tryfirst, so a plugin's class for a built-in name wins."""

    class ReplaceLlama:
        @hookimpl
        def octavo_register_models(self, register):
            register("LlamaForCausalLM", MyLlamaForCausalLM)

    register_plugin(ReplaceLlama())
    with octavo_logs.at_level(logging.INFO, logger="octavo"):
        llm = _llm(tiny_llama, num_gpu_blocks_override=64)
    assert type(llm.llm_engine.engine_core.executor.worker.model) is MyLlamaForCausalLM
    assert any(m == "model architecture LlamaForCausalLM: MyLlamaForCausalLM replaces "
                    "LlamaForCausalLM" for m in (r.getMessage() for r in octavo_logs.records))
    before = MyLlamaForCausalLM.num_forwards
    assert _token_ids(llm) == default_token_ids
    assert MyLlamaForCausalLM.num_forwards > before


# ---- octavo_worker_class ----------------------------------------------------------------------


class RecordingWorker(Worker):
    """The core's base worker on the host, recording that the executor drove it."""

    def init_device(self) -> None:
        self.device_initialised = True


def test_worker_class_override(tiny_llama, register_plugin, default_token_ids):
    class WorkerPlugin:
        @hookimpl(tryfirst=True)
        def octavo_worker_class(self, backend, parallel_config):
            assert parallel_config.tensor_parallel_size == 1
            return RecordingWorker if backend == "cpu" else None

    register_plugin(WorkerPlugin())
    llm = _llm(tiny_llama, num_gpu_blocks_override=64)
    worker = llm.llm_engine.engine_core.executor.worker
    assert type(worker) is RecordingWorker and worker.device_initialised
    assert _token_ids(llm) == default_token_ids


# ---- octavo_available_kv_cache_memory ---------------------------------------------------------


class FixedMemoryPlugin:
    """Gives the KV cache room for exactly ``num_blocks`` blocks (plus a few stray bytes)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_calls = 0

    @hookimpl(tryfirst=True)
    def octavo_available_kv_cache_memory(self, backend, worker, cache_config):
        if backend != "cpu":
            return None
        self.num_calls += 1
        assert worker.model is not None  # weights are loaded before the cache is sized
        return self.num_blocks * worker.kv_cache_bytes_per_block() + 5


def test_kv_cache_memory_hook_sets_the_block_count(tiny_llama, register_plugin, octavo_logs):
    plugin = register_plugin(FixedMemoryPlugin(num_blocks=37))
    with octavo_logs.at_level(logging.INFO, logger="octavo"):
        llm = _llm(tiny_llama)
    assert plugin.num_calls == 1
    assert llm.llm_engine.num_blocks == 37
    assert llm.llm_engine.num_free_blocks == 37
    assert any(r.getMessage().startswith("backend cpu: 37 KV blocks of 16 tokens")
               for r in octavo_logs.records), [r.getMessage() for r in octavo_logs.records]
    assert len(_token_ids(llm)) == len(PROMPTS)


def test_kv_cache_memory_hook_is_skipped_with_a_block_override(tiny_llama, register_plugin):
    plugin = register_plugin(FixedMemoryPlugin(num_blocks=37))
    llm = _llm(tiny_llama, num_gpu_blocks_override=20)
    assert plugin.num_calls == 0 and llm.llm_engine.num_blocks == 20


def test_too_little_kv_memory_is_a_clear_error(tiny_llama, register_plugin):
    register_plugin(FixedMemoryPlugin(num_blocks=0))
    with pytest.raises(RuntimeError, match="no memory left for the KV cache"):
        _llm(tiny_llama)


def test_register_quantization_methods_adds_a_method(register_plugin):
    """A plugin's method is listed beside the built-in ones (what --quantization accepts)."""
    from octavo.model_executor.layers.quantization.fp8 import Fp8Config
    from octavo.model_executor.layers.quantization.registry import build_quantization_registry

    class MyFp8(Fp8Config):
        name = "my-fp8"

    class QuantPlugin:
        @hookimpl
        def octavo_register_quantization_methods(self, register):
            register("my-fp8", MyFp8)

    register_plugin(QuantPlugin())
    registry = build_quantization_registry(get_plugin_manager())
    assert registry.get("my-fp8") is MyFp8
    assert {"fp8", "gguf", "gptq", "awq", "compressed-tensors"} <= set(registry.names())
