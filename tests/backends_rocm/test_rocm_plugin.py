"""The ROCm backend's plugin, probe, memory sizing and worker, without an AMD GPU.

Which torch build is running is faked by monkeypatching ``torch.version`` and ``torch.cuda``
(no HIP runtime is involved): a ROCm torch has ``torch.version.hip`` set and
``torch.version.cuda`` None, a CUDA torch the reverse, a CPU torch neither. What this checks is
the backends' decisions on those answers, not that a real ROCm torch gives them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import octavo_rocm.plugin as rocm_plugin
import pytest
import torch
from octavo.backends import select_backend
from octavo.config import CacheConfig
from octavo.plugins import build_plugin_manager

REPO = Path(__file__).resolve().parents[2]
HIP_VERSION = "6.2.41133-dd7f95766"


def fake_torch(monkeypatch, *, hip=None, cuda=None, devices=0, name="AMD Instinct MI300X",
               arch="gfx942:sramecc+:xnack-"):
    """Make torch look like a ROCm (``hip``), CUDA (``cuda``) or CPU build with ``devices``."""
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    props = SimpleNamespace(name=name, gcnArchName=arch) if hip else SimpleNamespace(name=name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


def _manager(*modules):
    """A manager with only the given backend plugin modules (no other installed entry point)."""
    pm = build_plugin_manager(load_entry_points=False)
    for module in modules:
        pm.register(module, name=module.__name__)
    pm.check_pending()
    return pm


# ---- availability probe -----------------------------------------------------------------------


def test_hip_torch_with_a_device_is_available(monkeypatch):
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=8)
    answer = rocm_plugin.probe_rocm()
    assert answer.available, answer.reason
    assert answer.reason == f"8 x AMD Instinct MI300X (gfx942:sramecc+:xnack-), HIP {HIP_VERSION}"


def test_cuda_torch_is_not_taken_as_rocm(monkeypatch):
    fake_torch(monkeypatch, cuda="12.8", devices=1, name="NVIDIA H100 80GB HBM3")
    answer = rocm_plugin.probe_rocm()
    assert not answer.available
    assert "CUDA build (CUDA 12.8), not ROCm" in answer.reason
    assert "octavo-backend-cuda" in answer.reason


def test_cpu_torch_is_not_rocm(monkeypatch):
    fake_torch(monkeypatch)
    answer = rocm_plugin.probe_rocm()
    assert not answer.available and "CPU-only build" in answer.reason


def test_hip_torch_without_a_device_says_why(monkeypatch):
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=0)
    answer = rocm_plugin.probe_rocm()
    assert not answer.available
    assert f"ROCm build (HIP {HIP_VERSION}) but no AMD GPU is visible" in answer.reason
    assert "HIP_VISIBLE_DEVICES" in answer.reason and "/dev/kfd" in answer.reason


def test_hip_torch_without_triton_says_why(monkeypatch):
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=1)
    real_find_spec = rocm_plugin.importlib.util.find_spec
    monkeypatch.setattr(rocm_plugin.importlib.util, "find_spec",
                        lambda name: None if name == "triton" else real_find_spec(name))
    answer = rocm_plugin.probe_rocm()
    assert not answer.available and "pytorch-triton-rocm" in answer.reason


def test_cuda_backend_refuses_a_hip_torch(monkeypatch):
    cuda_plugin = pytest.importorskip("octavo_cuda.plugin")
    # A ROCm torch answers torch.cuda.is_available() with True: only torch.version.hip tells.
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=1)
    answer = cuda_plugin.probe_cuda()
    assert not answer.available and "ROCm (HIP) build" in answer.reason
    assert "octavo-backend-rocm" in answer.reason


# ---- selection among the real backend plugins -------------------------------------------------


@pytest.mark.parametrize(
    "build, expected",
    [
        ({"hip": HIP_VERSION, "devices": 2}, "rocm"),
        ({"cuda": "12.8", "devices": 2}, "cuda"),
        ({"hip": HIP_VERSION, "devices": 0}, "cpu"),
        ({}, "cpu"),
    ],
    ids=["rocm-gpu", "cuda-gpu", "rocm-no-gpu", "cpu-torch"],
)
def test_default_selection_picks_the_matching_backend(monkeypatch, build, expected):
    import octavo_cpu.plugin

    cuda_plugin = pytest.importorskip("octavo_cuda.plugin")
    fake_torch(monkeypatch, **build)
    pm = _manager(octavo_cpu.plugin, cuda_plugin, rocm_plugin)
    available = [b.name for b in _list(pm) if b.is_available().available]
    # Equal priorities are safe because the GPU probes exclude each other.
    assert {"cuda", "rocm"} & set(available) in ({"cuda"}, {"rocm"}, set())
    assert select_backend(pm).name == expected


def _list(pm):
    from octavo.backends import list_backends

    return list_backends(pm)


def test_device_rocm_on_a_cuda_torch_gives_the_reason(monkeypatch):
    from octavo.backends import BackendNotAvailableError

    fake_torch(monkeypatch, cuda="12.8", devices=1)
    with pytest.raises(BackendNotAvailableError, match="'rocm' is installed but not available"):
        select_backend(_manager(rocm_plugin), "rocm")


def test_backend_description():
    backends = []
    rocm_plugin.octavo_register_backends(register=backends.append)
    (backend,) = backends
    assert backend.name == "rocm" and backend.package == "octavo-backend-rocm"
    assert backend.device_type == "cuda"  # torch's device type for HIP devices
    assert backend.dist_backend == "nccl"  # RCCL on ROCm builds of torch
    assert backend.priority == 100
    caps = backend.capabilities
    assert caps.cuda_graphs is False
    assert set(caps.dtypes) == {"bfloat16", "float16", "float32"}
    assert caps.block_sizes == (8, 16, 32, 64)


def test_declared_head_dims_are_the_kernels():
    from octavo.kernels.triton.attention import SUPPORTED_HEAD_DIMS
    from octavo_rocm.attention import make_attention_backend

    backends = []
    rocm_plugin.octavo_register_backends(register=backends.append)
    assert backends[0].capabilities.head_dims == SUPPORTED_HEAD_DIMS
    assert make_attention_backend(None).supported_head_dims() == SUPPORTED_HEAD_DIMS


# ---- packaging ----------------------------------------------------------------------------------


def test_entry_point_is_installed():
    (point,) = [ep for ep in entry_points(group="octavo") if ep.name == "rocm"]
    assert point.value == "octavo_rocm.plugin"
    assert point.load() is rocm_plugin


def test_importing_the_plugin_is_cheap():
    code = (
        "import sys, octavo_rocm.plugin\n"
        "heavy = ('triton', 'octavo.kernels.triton', 'octavo_rocm.attention', "
        "'octavo_rocm.memory', 'octavo_rocm.worker', 'octavo_cuda')\n"
        "print(sorted(m for m in sys.modules\n"
        "             if any(m == h or m.startswith(h + '.') for h in heavy)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_rocm_package_does_not_import_the_cuda_backend():
    pattern = re.compile(r"^\s*(from|import)\s+octavo_cuda\b", re.MULTILINE)
    sources = list((REPO / "backends" / "rocm" / "src").rglob("*.py"))
    assert sources
    assert [str(p) for p in sources if pattern.search(p.read_text(encoding="utf-8"))] == []


# ---- hooks dispatch by backend name -------------------------------------------------------------


@pytest.mark.parametrize("other", ["cpu", "cuda", "mydev"])
def test_selection_hooks_answer_none_for_other_backends(other):
    assert rocm_plugin.octavo_attention_backend(
        backend=other, model_config=None, cache_config=None) is None
    assert rocm_plugin.octavo_available_kv_cache_memory(
        backend=other, worker=None, cache_config=None) is None
    assert rocm_plugin.octavo_worker_class(backend=other, parallel_config=None) is None


def test_selection_hooks_answer_for_rocm():
    from octavo.kernels.triton import TritonAttentionBackend
    from octavo_rocm.attention import ROCM_LAUNCH_CONFIG
    from octavo_rocm.worker import ROCmWorker

    attention = rocm_plugin.octavo_attention_backend(
        backend="rocm", model_config=None, cache_config=None)
    assert isinstance(attention, TritonAttentionBackend)
    assert attention.config is ROCM_LAUNCH_CONFIG
    assert rocm_plugin.octavo_worker_class(backend="rocm", parallel_config=None) is ROCmWorker
    cache = CacheConfig(kv_cache_memory_bytes=123 * 2**20)
    assert rocm_plugin.octavo_available_kv_cache_memory(
        backend="rocm", worker=None, cache_config=cache) == 123 * 2**20


def test_hooks_through_a_manager_with_cpu_and_rocm():
    import octavo_cpu.plugin
    from octavo_rocm.worker import ROCmWorker

    pm = _manager(octavo_cpu.plugin, rocm_plugin)
    assert pm.hook.octavo_worker_class(backend="rocm", parallel_config=None) is ROCmWorker
    cpu_worker = pm.hook.octavo_worker_class(backend="cpu", parallel_config=None)
    assert cpu_worker is not None and cpu_worker is not ROCmWorker
    assert pm.hook.octavo_worker_class(backend="nosuch", parallel_config=None) is None


# ---- memory sizing and worker, on a faked torch.cuda ---------------------------------------------

GIB = 2**30


def test_kv_cache_budget_arithmetic():
    from octavo_rocm.memory import MemoryProfile, kv_cache_budget

    # 192 GiB device; after profiling 150 GiB free, torch reserved 30 GiB (peak 20 GiB), so
    # 12 GiB are used outside torch (HIP context, other processes).
    profile = MemoryProfile(total=192 * GIB, free=150 * GIB, torch_peak=20 * GIB,
                            torch_reserved=30 * GIB)
    assert profile.outside_torch == 12 * GIB
    assert kv_cache_budget(profile, 0.9) == int(192 * GIB * 0.9) - 20 * GIB - 12 * GIB
    # Reserved above used (allocator statistics racing hipMemGetInfo) never adds memory.
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
    from octavo_rocm.memory import available_kv_cache_memory

    calls = []
    _fake_memory_api(monkeypatch, total=64 * GIB, free=40 * GIB, peak=16 * GIB,
                     reserved=20 * GIB, calls=calls)
    worker = FakeWorker()
    available = available_kv_cache_memory(worker, CacheConfig(gpu_memory_utilization=0.5))
    assert worker.profiled == 1
    assert calls[:3] == ["sync", "empty", "reset"]  # a clean peak counter before the run
    assert available == 32 * GIB - 16 * GIB - 4 * GIB


def test_available_memory_override_skips_profiling(monkeypatch):
    from octavo_rocm.memory import available_kv_cache_memory

    worker = FakeWorker()
    assert available_kv_cache_memory(worker, CacheConfig(kv_cache_memory_bytes=GIB)) == GIB
    assert worker.profiled == 0


def test_no_memory_left_is_a_clear_error(monkeypatch):
    from octavo_rocm.memory import available_kv_cache_memory

    # Budget 0.9 x 16 = 14.4 GiB; torch peaked at 14 GiB and 1 GiB is held outside torch.
    _fake_memory_api(monkeypatch, total=16 * GIB, free=1 * GIB, peak=14 * GIB,
                     reserved=14 * GIB, calls=[])
    with pytest.raises(RuntimeError, match=r"no GPU memory left for the KV cache .*\(HIP\)"
                                           r".*gpu_memory_utilization"):
        available_kv_cache_memory(FakeWorker(), CacheConfig(gpu_memory_utilization=0.9))


def test_worker_uses_torch_cuda_device_names(monkeypatch):
    from octavo_rocm.worker import ROCmWorker

    fake_torch(monkeypatch, hip=HIP_VERSION, devices=1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    worker = ROCmWorker(config=None, pm=None)
    worker.init_device()
    assert chosen == [0]
    assert worker.device == torch.device("cuda", 0)
