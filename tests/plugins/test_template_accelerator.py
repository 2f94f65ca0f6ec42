"""The template accelerator plugin (``plugins/template-accelerator``): found by entry point,
never the default backend, runs a model when named, and passes the conformance suite.

Needs the plugin installed: ``pip install --no-deps -e plugins/template-accelerator``.
"""

from __future__ import annotations

import pkgutil

import octavo
import octavo.testing.conformance
import pytest
from octavo.backends import list_backends, select_backend
from octavo.config import CacheConfig, ParallelConfig
from octavo.plugins import build_plugin_manager
from octavo.testing import run_conformance

from tests.helpers.engine import greedy, make_llm, token_ids
from tests.plugins.conftest import installed_entry_point

DISTRIBUTION = "octavo-plugin-template-accelerator"
SUITE_MODULES = {m.name for m in pkgutil.iter_modules(octavo.testing.conformance.__path__)
                 if m.name.startswith("test_")}


@pytest.fixture(scope="module")
def template_plugin():
    """The plugin (a ``BackendPlugin`` declaration), loaded through its installed entry point."""
    return installed_entry_point("template", DISTRIBUTION).load()


def _manager(*plugins):
    pm = build_plugin_manager(load_entry_points=False)
    for name, plugin in plugins:
        pm.register(plugin, name=name)
    return pm


def test_the_installed_plugin_registers_the_template_backend(template_plugin):
    backends = {b.name: b for b in list_backends(build_plugin_manager())}
    template = backends["template"]
    assert template.package == DISTRIBUTION and template.device_type == "cpu"
    assert template.is_available().available
    assert template.priority < backends["cpu"].priority


def test_installing_it_never_changes_the_default_backend(template_plugin):
    import octavo_cpu.plugin

    both = _manager(("cpu", octavo_cpu.plugin.plugin), ("template", template_plugin))
    assert select_backend(both).name == "cpu"
    assert select_backend(both, "template").name == "template"
    alone = _manager(("template", template_plugin))
    assert select_backend(alone).name == "template"  # the only backend: chosen


def test_selection_hooks_answer_only_for_the_template(template_plugin):
    assert template_plugin.octavo_worker_class(backend="cpu", parallel_config=ParallelConfig()) is None
    assert template_plugin.octavo_attention_backend(
        backend="cpu", model_config=None, cache_config=CacheConfig()) is None
    assert template_plugin.octavo_available_kv_cache_memory(
        backend="cpu", worker=None, cache_config=CacheConfig()) is None


def test_generate_on_the_template_equals_the_cpu_backend(template_plugin, tiny_llama):
    llm = make_llm(tiny_llama, device="template", num_gpu_blocks_override=None,
                   kv_cache_memory_bytes=None, max_num_seqs=4, max_model_len=128)
    worker = llm.llm_engine.engine_core.executor.worker
    assert type(worker).__name__ == "TemplateWorker"
    assert worker.model_runner.attn_backend.name == "template-torch"
    prompts = ["The capital of France is", "Hello world"]
    cpu = make_llm(tiny_llama, device="cpu")
    assert token_ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == token_ids(
        cpu.generate(prompts, greedy(8), use_tqdm=False))


def test_the_template_passes_the_conformance_suite(template_plugin):
    report = run_conformance("template", timeout_s=600)
    assert report.ok, report.summary()
    assert not report.with_outcome("skipped"), report.summary()
    assert report.modules == SUITE_MODULES, report.summary()
