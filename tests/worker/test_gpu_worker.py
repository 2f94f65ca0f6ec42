"""The core's GPU worker and GPU memory sizing (shared by the CUDA and ROCm backends), on a
faked ``torch.cuda``: no GPU is involved. What this checks is the arithmetic and the order of
calls; the real thing runs in the GPU suite (backends/cuda/tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from octavo.config import CacheConfig
from octavo.worker.gpu_memory import MemoryProfile, available_kv_cache_memory, kv_cache_budget
from octavo.worker.gpu_worker import GPUWorker

GIB = 2**30
ONE_RANK = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)


def test_kv_cache_budget_arithmetic():
    # 192 GiB device; after profiling 150 GiB free, torch reserved 30 GiB (peak 20 GiB), so
    # 12 GiB are used outside torch (driver context, other processes).
    profile = MemoryProfile(total=192 * GIB, free=150 * GIB, torch_peak=20 * GIB,
                            torch_reserved=30 * GIB)
    assert profile.outside_torch == 12 * GIB
    assert kv_cache_budget(profile, 0.9) == int(192 * GIB * 0.9) - 20 * GIB - 12 * GIB
    # Reserved above used (allocator statistics racing mem_get_info) never adds memory.
    odd = MemoryProfile(total=100, free=90, torch_peak=5, torch_reserved=20)
    assert odd.outside_torch == 0 and kv_cache_budget(odd, 0.5) == 45


class FakeWorker:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.profiled = 0

    def profile_run(self) -> None:
        self.profiled += 1


def _fake_memory_api(monkeypatch, total, free, peak, reserved, calls):
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: reserved)


def test_available_memory_profiles_then_fills_the_budget(monkeypatch):
    calls = []
    _fake_memory_api(monkeypatch, total=64 * GIB, free=40 * GIB, peak=16 * GIB,
                     reserved=20 * GIB, calls=calls)
    worker = FakeWorker()
    available = available_kv_cache_memory(worker, CacheConfig(gpu_memory_utilization=0.5))
    assert worker.profiled == 1
    assert calls[:3] == ["sync", "empty", "reset"]  # a clean peak counter before the run
    assert available == 32 * GIB - 16 * GIB - 4 * GIB


def test_available_memory_override_skips_profiling():
    worker = FakeWorker()
    assert available_kv_cache_memory(worker, CacheConfig(kv_cache_memory_bytes=GIB)) == GIB
    assert worker.profiled == 0


def test_no_memory_left_is_a_clear_error(monkeypatch):
    # Budget 0.9 x 16 = 14.4 GiB; torch peaked at 14 GiB and 1 GiB is held outside torch.
    _fake_memory_api(monkeypatch, total=16 * GIB, free=1 * GIB, peak=14 * GIB,
                     reserved=14 * GIB, calls=[])
    with pytest.raises(RuntimeError, match=r"no GPU memory left for the KV cache on cpu.*"
                                           r"gpu_memory_utilization"):
        available_kv_cache_memory(FakeWorker(), CacheConfig(gpu_memory_utilization=0.9))


@pytest.mark.parametrize("props", [
    SimpleNamespace(name="NVIDIA H100 80GB HBM3"),
    SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-"),
], ids=["cuda", "rocm"])
def test_worker_binds_the_device_by_torch_cuda_names(monkeypatch, props):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = SimpleNamespace(backend="rocm" if hasattr(props, "gcnArchName") else "cuda",
                             parallel_config=ONE_RANK)
    worker = GPUWorker(config=config, pm=None)
    worker.init_device()
    assert chosen == [0]
    assert worker.device == torch.device("cuda", 0)


@pytest.mark.parametrize("cuda_graphs, enforce_eager", [(False, False), (True, True)])
def test_no_graph_runner_when_not_declared_or_eager(cuda_graphs, enforce_eager):
    config = SimpleNamespace(
        backend="cuda",
        backend_capabilities=SimpleNamespace(cuda_graphs=cuda_graphs),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        parallel_config=ONE_RANK,
    )
    assert GPUWorker(config=config, pm=None).make_graph_runner() is None


@pytest.mark.parametrize("speculating, multi_token, want", [
    (False, True, 1), (True, True, 5), (True, False, 1)])
def test_verification_steps_are_captured_when_speculating_on_a_backend_that_can(
        speculating, multi_token, want):
    config = SimpleNamespace(
        backend="cuda",
        backend_capabilities=SimpleNamespace(cuda_graphs=True,
                                             cuda_graphs_multi_token=multi_token),
        speculative_config=SimpleNamespace(num_speculative_tokens=4) if speculating else None,
        parallel_config=ONE_RANK,
    )
    assert GPUWorker(config=config, pm=None)._verification_query_len() == want


def test_a_rank_beyond_the_visible_gpus_says_what_to_change(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = SimpleNamespace(backend="cuda", parallel_config=SimpleNamespace(
        tensor_parallel_size=2, pipeline_parallel_size=1))
    with pytest.raises(RuntimeError, match="rank 1 needs GPU 1, but this process sees 1"):
        GPUWorker(config=config, pm=None, rank=1).init_device()


def test_torch_host_ops_get_one_thread_unless_omp_num_threads_is_set(monkeypatch) -> None:
    from octavo.worker.gpu_worker import _one_cpu_thread_for_torch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        _one_cpu_thread_for_torch()
        assert torch.get_num_threads() == 2  # the user's choice stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        _one_cpu_thread_for_torch()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
