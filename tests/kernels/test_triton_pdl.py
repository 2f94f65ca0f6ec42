"""Programmatic dependent launch of the decode step's Triton kernels
(``octavo.kernels.triton.pdl``): when it is on, and on a GPU that it keeps every kernel's
result (a chain of dependent kernels, eager and replayed from a CUDA graph, equal to the
same chain without it)."""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.triton import cache_write
from octavo.kernels.triton import pdl as pdl_module
from octavo.kernels.triton.pdl import pdl_launch


@pytest.fixture
def fresh_choice():
    """Each test decides anew (the choice is read once per process)."""
    pdl_module._launch_for.cache_clear()
    pdl_module._skinny_on.cache_clear()
    yield
    pdl_module._launch_for.cache_clear()
    pdl_module._skinny_on.cache_clear()


def test_off_on_the_cpu():
    assert pdl_launch(torch.device("cpu")) == {"USE_PDL": False}


@pytest.mark.parametrize("capability, hip, env, interpreted, on", [
    ((9, 0), None, None, False, True),  # Hopper
    ((10, 0), None, None, False, True),  # Blackwell
    ((8, 0), None, None, False, False),  # Ampere: no griddepcontrol
    ((9, 0), "6.2", None, False, False),  # ROCm
    ((9, 0), None, "0", False, False),  # switched off
    ((9, 0), None, None, True, False),  # the interpreter has no grid dependencies
])
def test_on_for_cuda_gpus_of_compute_capability_9_and_later(fresh_choice, monkeypatch,
                                                             capability, hip, env,
                                                             interpreted, on):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(cache_write, "interpreting", lambda: interpreted)
    if env is None:
        monkeypatch.delenv("OCTAVO_PDL", raising=False)
    else:
        monkeypatch.setenv("OCTAVO_PDL", env)
    expected = {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
    assert pdl_launch(torch.device("cuda", 0)) == expected


@pytest.mark.parametrize("rows, env, on", [(1, None, True), (2, None, False), (16, None, False),
                                           (1, "0", False), (0, None, False)])
def test_small_m_kernels_launch_with_pdl_at_one_row_only(fresh_choice, monkeypatch, rows, env,
                                                          on):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(cache_write, "interpreting", lambda: False)
    monkeypatch.delenv("OCTAVO_PDL", raising=False)
    if env is None:
        monkeypatch.delenv("OCTAVO_SKINNY_PDL", raising=False)
    else:
        monkeypatch.setenv("OCTAVO_SKINNY_PDL", env)
    expected = {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
    assert pdl_module.skinny_pdl_launch(torch.device("cuda", 0), rows) == expected


def _chain(x: torch.Tensor, weight: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``steps`` fused add-norms and SiLU-and-muls, each reading what the one before wrote."""
    from octavo.kernels.triton.activation import silu_and_mul
    from octavo.kernels.triton.rmsnorm import fused_add_rms_norm

    residual = torch.zeros_like(x)
    outs = []
    for _ in range(steps):
        normed, residual = fused_add_rms_norm(x, residual, weight, 1e-6)
        x = silu_and_mul(torch.cat([normed, normed], dim=-1))
        outs.append(x)
    return outs


@pytest.mark.gpu
def test_dependent_kernels_with_pdl_equal_the_chain_without_it_on_gpu(fresh_choice,
                                                                      monkeypatch):
    """40 dependent launches: with PDL (eager, then replayed 20 times from one graph) each
    output is bit-identical to plain stream order (no kernel read its input early)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    monkeypatch.setenv("OCTAVO_PDL", "0")
    plain = _chain(x, weight, 20)
    pdl_module._launch_for.cache_clear()
    monkeypatch.setenv("OCTAVO_PDL", "1")
    assert pdl_launch(x.device)["USE_PDL"]
    eager = _chain(x, weight, 20)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(x, weight, 20)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, plain):
            assert torch.equal(a, b)
    for a, b in zip(eager, plain):
        assert torch.equal(a, b)
