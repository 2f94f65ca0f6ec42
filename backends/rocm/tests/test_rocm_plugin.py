"""The ROCm backend's declaration and probe, without an AMD GPU (its memory sizing and worker
are the core's GPU ones: tests/worker/test_gpu_worker.py).

Which torch build is running is faked by monkeypatching ``torch.version`` and ``torch.cuda``
(no HIP runtime is involved): a ROCm torch has ``torch.version.hip`` set and
``torch.version.cuda`` None, a CUDA torch the reverse, a CPU torch neither. What this checks is
the backends' decisions on those answers, not that a real ROCm torch gives them.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import octavo_rocm.plugin as rocm_module
import pytest
import torch
from octavo.backends import select_backend
from octavo.config import CacheConfig
from octavo.plugins import build_plugin_manager

from tests.helpers.imports import modules_loaded_by

REPO = Path(__file__).resolve().parents[3]
rocm_plugin = rocm_module.plugin
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


def _manager(*plugins):
    """A manager with only the given backend plugins (no other installed entry point)."""
    pm = build_plugin_manager(load_entry_points=False)
    for plugin in plugins:
        pm.register(plugin, name=plugin.backend.name)
    pm.check_pending()
    return pm


# ---- availability probe -----------------------------------------------------------------------


def test_hip_torch_with_a_device_is_available(monkeypatch):
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=8)
    answer = rocm_module.probe_rocm()
    assert answer.available, answer.reason
    assert answer.reason == f"8 x AMD Instinct MI300X (gfx942:sramecc+:xnack-), HIP {HIP_VERSION}"


def test_cuda_torch_is_not_taken_as_rocm(monkeypatch):
    fake_torch(monkeypatch, cuda="12.8", devices=1, name="NVIDIA H100 80GB HBM3")
    answer = rocm_module.probe_rocm()
    assert not answer.available
    assert "CUDA build (CUDA 12.8), not ROCm" in answer.reason
    assert "octavo-backend-cuda" in answer.reason


def test_cpu_torch_is_not_rocm(monkeypatch):
    fake_torch(monkeypatch)
    answer = rocm_module.probe_rocm()
    assert not answer.available and "CPU-only build" in answer.reason


def test_hip_torch_without_a_device_says_why(monkeypatch):
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=0)
    answer = rocm_module.probe_rocm()
    assert not answer.available
    assert f"ROCm build (HIP {HIP_VERSION}) but no AMD GPU is visible" in answer.reason
    assert "HIP_VISIBLE_DEVICES" in answer.reason and "/dev/kfd" in answer.reason


def test_hip_torch_without_triton_says_why(monkeypatch):
    fake_torch(monkeypatch, hip=HIP_VERSION, devices=1)
    real_find_spec = rocm_module.importlib.util.find_spec
    monkeypatch.setattr(rocm_module.importlib.util, "find_spec",
                        lambda name: None if name == "triton" else real_find_spec(name))
    answer = rocm_module.probe_rocm()
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

    cuda_plugin = pytest.importorskip("octavo_cuda.plugin").plugin
    fake_torch(monkeypatch, **build)
    pm = _manager(octavo_cpu.plugin.plugin, cuda_plugin, rocm_plugin)
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
    assert caps.cuda_graphs is True  # HIP graphs through the core's graph runner
    assert set(caps.dtypes) == {"bfloat16", "float16", "float32"}
    assert caps.block_sizes == (8, 16, 32, 64)


def test_declared_head_dims_are_the_kernels():
    from octavo.kernels.triton.attention import SUPPORTED_HEAD_DIMS
    from octavo_rocm.attention import make_attention_backend

    backends = []
    rocm_plugin.octavo_register_backends(register=backends.append)
    assert backends[0].capabilities.head_dims == SUPPORTED_HEAD_DIMS
    assert make_attention_backend(None, None).supported_head_dims() == SUPPORTED_HEAD_DIMS


# ---- packaging ----------------------------------------------------------------------------------


def test_entry_point_is_installed():
    (point,) = [ep for ep in entry_points(group="octavo") if ep.name == "rocm"]
    assert point.value == "octavo_rocm.plugin:plugin"
    assert point.load() is rocm_plugin


def test_importing_the_plugin_is_cheap():
    watched = ("torch", "triton", "octavo.kernels.triton", "octavo_rocm.attention", "octavo.worker",
               "octavo_cuda")
    assert modules_loaded_by("import octavo_rocm.plugin", watched) == []


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
    from octavo.worker.gpu_memory import available_kv_cache_memory
    from octavo.worker.gpu_worker import GPUWorker
    from octavo_rocm.attention import ROCM_LAUNCH_CONFIG

    attention = rocm_plugin.octavo_attention_backend(
        backend="rocm", model_config=None, cache_config=None)
    assert isinstance(attention, TritonAttentionBackend)
    assert attention.config is ROCM_LAUNCH_CONFIG
    assert rocm_plugin.octavo_worker_class(backend="rocm", parallel_config=None) is GPUWorker
    assert rocm_plugin.kv_cache_memory.endswith(available_kv_cache_memory.__name__)
    cache = CacheConfig(kv_cache_memory_bytes=123 * 2**20)
    assert rocm_plugin.octavo_available_kv_cache_memory(
        backend="rocm", worker=None, cache_config=cache) == 123 * 2**20


def test_hooks_through_a_manager_with_cpu_and_rocm():
    import octavo_cpu.plugin
    from octavo.worker.gpu_worker import GPUWorker

    pm = _manager(octavo_cpu.plugin.plugin, rocm_plugin)
    assert pm.hook.octavo_worker_class(backend="rocm", parallel_config=None) is GPUWorker
    cpu_worker = pm.hook.octavo_worker_class(backend="cpu", parallel_config=None)
    assert cpu_worker is not None and cpu_worker is not GPUWorker
    assert pm.hook.octavo_worker_class(backend="nosuch", parallel_config=None) is None
