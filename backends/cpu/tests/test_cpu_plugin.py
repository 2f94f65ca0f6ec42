"""The CPU backend's declaration: registration, dispatch by name, KV-cache sizing."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import octavo_cpu.memory
import pytest
from octavo.backends import Backend, list_backends, select_backend
from octavo.config import CacheConfig, ParallelConfig
from octavo.plugins import build_plugin_manager
from octavo.worker.worker import Worker
from octavo_cpu.attention import CPUAttentionBackend
from octavo_cpu.plugin import plugin
from octavo_cpu.worker import CPUWorker

from tests.helpers.imports import modules_loaded_by

PER_BLOCK = 8192  # bytes of one KV block (all layers) of the fake worker
GiB = 2**30

_VirtualMemory = namedtuple("_VirtualMemory", "total available")


def _fake_worker(max_num_seqs: int, max_model_len: int):
    """Just what the memory hook reads: the scheduler/model limits and the bytes per block
    (``max_useful_kv_cache_bytes`` is the real ``Worker``'s, on these figures)."""
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        cache_config=CacheConfig(),
    )
    worker = SimpleNamespace(config=config, kv_cache_bytes_per_block=lambda: PER_BLOCK)
    worker.max_useful_kv_cache_bytes = lambda: Worker.max_useful_kv_cache_bytes(worker)
    return worker


@pytest.fixture
def host_memory(monkeypatch):
    """Pretend the host has ``available`` bytes available (psutil patched)."""

    def set_available(available: int) -> None:
        monkeypatch.setattr(octavo_cpu.memory.psutil, "virtual_memory",
                            lambda: _VirtualMemory(total=2 * available, available=available))

    return set_available


def _kv_memory(worker, cache_config, backend="cpu"):
    worker.config.cache_config = cache_config  # one CacheConfig, as in an engine
    return plugin.octavo_available_kv_cache_memory(
        backend=backend, worker=worker, cache_config=cache_config)


def test_kv_cache_memory_bytes_is_honoured_exactly(host_memory):
    host_memory(1 * GiB)
    worker = _fake_worker(max_num_seqs=1, max_model_len=16)  # the cap would be one block
    cache = CacheConfig(kv_cache_memory_bytes=123_456_789)
    assert _kv_memory(worker, cache) == 123_456_789


def test_fixed_default_of_4_gib_whatever_memory_is_free(host_memory, monkeypatch):
    monkeypatch.delenv("OCTAVO_CPU_KVCACHE_SPACE", raising=False)
    worker = _fake_worker(max_num_seqs=256, max_model_len=131072)  # cap far above the budget
    for available in (8 * GiB, 13 * GiB, 100 * GiB):
        host_memory(available)
        assert _kv_memory(worker, CacheConfig()) == 4 * GiB
    host_memory(6 * GiB)  # a small machine: half of what is available
    assert _kv_memory(worker, CacheConfig()) == 3 * GiB


def test_space_flag_then_env_var_then_default(host_memory, monkeypatch):
    host_memory(16 * GiB)
    worker = _fake_worker(max_num_seqs=256, max_model_len=131072)
    monkeypatch.setenv("OCTAVO_CPU_KVCACHE_SPACE", "1.5")
    assert _kv_memory(worker, CacheConfig()) == int(1.5 * GiB)
    assert _kv_memory(worker, CacheConfig(cpu_kv_cache_space=0.5)) == GiB // 2
    with pytest.raises(RuntimeError, match=r"asked for 32 GiB \(cpu_kv_cache_space\).*16.00 GiB"):
        _kv_memory(worker, CacheConfig(cpu_kv_cache_space=32))
    monkeypatch.setenv("OCTAVO_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="OCTAVO_CPU_KVCACHE_SPACE must be a size in GiB > 0, got 'lots'"):
        _kv_memory(worker, CacheConfig())


def test_fraction_of_available_host_memory_when_asked(host_memory):
    host_memory(8 * GiB)
    worker = _fake_worker(max_num_seqs=256, max_model_len=131072)  # cap far above the budget
    assert _kv_memory(worker, CacheConfig(cpu_kv_cache_fraction=0.25)) == 2 * GiB
    assert _kv_memory(worker, CacheConfig(cpu_kv_cache_fraction=0.5)) == 4 * GiB


def test_capped_at_what_max_num_seqs_sequences_can_use(host_memory):
    host_memory(8 * GiB)
    worker = _fake_worker(max_num_seqs=3, max_model_len=100)
    # 300 tokens -> ceil(300 / 16) = 19 blocks of PER_BLOCK bytes, far below 2 GiB.
    assert _kv_memory(worker, CacheConfig(block_size=16)) == 19 * PER_BLOCK
    assert _kv_memory(worker, CacheConfig(block_size=32)) == 10 * PER_BLOCK


def test_selection_hooks_answer_only_for_cpu(host_memory):
    host_memory(GiB)
    worker = _fake_worker(1, 16)
    model_config = SimpleNamespace()  # not read by the CPU hook
    assert _kv_memory(worker, CacheConfig(), backend="cuda") is None
    assert plugin.octavo_worker_class(backend="cuda", parallel_config=ParallelConfig()) is None
    assert plugin.octavo_attention_backend(
        backend="cuda", model_config=model_config, cache_config=CacheConfig()) is None
    assert plugin.octavo_worker_class(backend="cpu", parallel_config=ParallelConfig()) is CPUWorker
    assert isinstance(plugin.octavo_attention_backend(
        backend="cpu", model_config=model_config, cache_config=CacheConfig()),
        CPUAttentionBackend)


def test_registers_one_available_cpu_backend():
    pm = build_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="cpu")
    pm.check_pending()
    (backend,) = list_backends(pm)
    assert isinstance(backend, Backend)
    assert (backend.name, backend.device_type, backend.package) == (
        "cpu", "cpu", "octavo-backend-cpu")
    answer = backend.is_available()
    assert answer.available and "CPU cores" in answer.reason
    assert select_backend(pm).name == "cpu"
    assert {"float32", "bfloat16"} <= set(backend.capabilities.dtypes)


def test_memory_hook_through_the_plugin_manager(host_memory):
    """The hook as the worker calls it: by keyword, first non-None result wins."""
    host_memory(4 * GiB)
    pm = build_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="cpu")
    worker = _fake_worker(max_num_seqs=2, max_model_len=64)
    got = pm.hook.octavo_available_kv_cache_memory(
        backend="cpu", worker=worker, cache_config=CacheConfig())
    assert got == 8 * PER_BLOCK
    assert pm.hook.octavo_available_kv_cache_memory(
        backend="nosuch", worker=worker, cache_config=CacheConfig()) is None


def test_entry_point_module_is_cheap_to_import():
    """Discovery imports ``octavo_cpu.plugin`` only: no torch, no kernels, no psutil."""
    watched = ("torch", "psutil", "octavo_cpu.attention", "octavo_cpu.memory", "octavo_cpu.worker")
    assert modules_loaded_by("import octavo_cpu.plugin", watched) == []


def test_entry_point_names_the_declaration():
    from importlib.metadata import entry_points

    (point,) = [ep for ep in entry_points(group="octavo") if ep.name == "cpu"]
    assert point.value == "octavo_cpu.plugin:plugin"
    assert point.load() is plugin
