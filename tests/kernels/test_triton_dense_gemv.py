"""The one-row dense GEMV (``octavo.kernels.triton.dense_gemv``) against ``F.linear`` in
float32: under the interpreter at small shapes (one program per block, K split with the sums
done in the kernel, masked tails of N and K, a bias), and on the GPU at Qwen2.5-0.5B's and
Llama-3-8B's layer shapes with PDL on, eagerly and replayed from a CUDA graph after the
kernels that produce its input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from octavo.kernels.dense import dense_linear, uses_one_row_kernel
from octavo.kernels.triton import dense_gemv as dense_gemv_module
from octavo.kernels.triton.dense_gemv import candidate_configs, dense_gemv, launch, sum_run
from octavo.kernels.triton.rmsnorm import rms_norm
from octavo.kernels.triton.skinny_gemm import SkinnyConfig

from tests.kernels.conftest import DEVICE

SMALL_CONFIGS = [SkinnyConfig(block_n=8, block_k=64, split_k=1),
                 SkinnyConfig(block_n=16, block_k=32, split_k=3),
                 # each step's products summed over 8-input runs first
                 SkinnyConfig(block_n=8, block_k=64, split_k=2, sum_runs=True),
                 # later steps' loads issued ahead (a pipelined loop on a GPU)
                 SkinnyConfig(block_n=8, block_k=32, split_k=1, load_stages=3)]


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max()
            / expected.float().abs().max().clamp(min=1e-6)).item()


def operands(n: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(device=device, dtype=dtype)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    return x, weight, bias


@pytest.mark.parametrize("config", SMALL_CONFIGS,
                         ids=["one-split", "split-3", "sum-runs", "pipelined"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("early_trigger", [False, True], ids=["late", "early"])
# N and K not multiples of the blocks (masked rows and a masked last step), or whole blocks
# and steps (loads without masks)
@pytest.mark.parametrize("n, k", [(37, 200), (32, 192)], ids=["tails", "whole"])
def test_matches_linear(config, dtype, with_bias, early_trigger, n, k):
    x, weight, bias = operands(n=n, k=k, dtype=dtype)
    bias = bias if with_bias else None
    out = launch(x, weight, bias, config, early_trigger=early_trigger)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.shape == (1, n) and out.dtype == dtype
    assert relative_error(out, expected) < 1e-2


def test_default_and_candidates_run_under_the_interpreter():
    x, weight, bias = operands(n=24, k=96, dtype=torch.bfloat16, seed=1)
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert relative_error(dense_gemv(x, weight, bias), expected) < 1e-2
    # The tuner's candidates are valid launches (cut to this shape's K by masks)
    for config in candidate_configs()[:3]:
        assert relative_error(launch(x, weight, bias, config), expected) < 1e-2


def test_runs_summed_first_take_one_vector_load_of_inputs():
    """``SkinnyConfig.sum_runs``: each thread's 16 bytes of inputs (8 bfloat16, 16 e4m3),
    where a step holds whole runs; nothing otherwise."""
    bf16, e4m3 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.float8_e4m3fn)
    runs = SkinnyConfig(8, 64, sum_runs=True)
    assert (sum_run(runs, bf16), sum_run(runs, e4m3)) == (8, 16)
    assert sum_run(SkinnyConfig(8, 8, sum_runs=True), e4m3) == 0  # a step of 8: no whole run
    assert sum_run(SkinnyConfig(8, 64), bf16) == 0


def test_bias_added_once_over_splits():
    x, weight, bias = operands(n=16, k=128, dtype=torch.float16, seed=2)
    bias = torch.full_like(bias, 100.0)  # a bias added by every split would show as 400
    out = launch(x, weight, bias, SkinnyConfig(block_n=16, block_k=32, split_k=4))
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert relative_error(out, expected) < 1e-2


def test_a_split_past_k_matches_linear():
    """Regression: 8 splits of 19 steps of 32 are 7 programs; an 8th, empty, would run the
    peeled first step past K."""
    x, weight, bias = operands(n=32, k=608, dtype=torch.bfloat16, seed=3)
    out = launch(x, weight, bias, SkinnyConfig(block_n=32, block_k=32, split_k=8))
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert relative_error(out, expected) < 1e-2


def test_a_launch_takes_the_configs_trigger_unless_told(monkeypatch):
    """The config tables record each shape's trigger (``SkinnyConfig.early_trigger``); an
    explicit ``early_trigger`` (the benchmark's variants) overrides it."""
    triggers = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: triggers.append(kwargs["EARLY_TRIGGER"])

    monkeypatch.setattr(dense_gemv_module, "_dense_gemv_kernel", Recorder())
    x, weight, bias = operands(n=16, k=64, dtype=torch.bfloat16)
    late = SkinnyConfig(block_n=8, block_k=32, split_k=1, early_trigger=False)
    launch(x, weight, bias, late)
    launch(x, weight, bias, late, early_trigger=True)
    launch(x, weight, bias, SkinnyConfig(block_n=8, block_k=32, split_k=1))
    dense_gemv(x, weight, bias, late)
    assert triggers == [False, True, True, False]


@pytest.mark.parametrize("bad", ["two rows", "dtype", "k", "bias", "strided"])
def test_bad_operands_are_refused(bad):
    x, weight, bias = operands(n=8, k=32, dtype=torch.bfloat16)
    if bad == "two rows":
        x = torch.cat([x, x])
    elif bad == "dtype":
        weight = weight.half()
    elif bad == "k":
        weight = weight[:, :16]
    elif bad == "bias":
        bias = bias[:4]
    else:
        weight = weight.t().contiguous().t()
    with pytest.raises(ValueError, match="dense_gemv"):
        dense_gemv(x, weight, bias)


def test_dense_linear_is_f_linear_off_the_gpu_and_for_more_rows():
    x, weight, bias = operands(n=24, k=32, dtype=torch.bfloat16, device="cpu")
    assert not uses_one_row_kernel(x, weight, bias)
    assert torch.equal(dense_linear(x, weight, bias), F.linear(x, weight, bias))
    rows = torch.cat([x, x, x])
    assert torch.equal(dense_linear(rows, weight, None), F.linear(rows, weight))


@pytest.mark.gpu
def test_dense_linear_takes_the_one_row_kernel_where_pdl_is_on_gpu():
    x, weight, bias = operands(n=512, k=256, dtype=torch.bfloat16, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert uses_one_row_kernel(x, weight, bias) == hopper
    assert not uses_one_row_kernel(torch.cat([x, x]), weight, bias)  # two rows: cuBLAS
    assert not uses_one_row_kernel(x.float(), weight.float(), None)  # float32: cuBLAS
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert relative_error(dense_linear(x, weight, bias), expected) < 1e-2


SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864),
          (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
def test_model_shapes_after_a_norm_eager_and_in_a_graph_on_gpu(n, k):
    x, weight, bias = operands(n, k, torch.bfloat16, device="cuda")
    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(rms_norm(x, norm_weight, 1e-6).float(), weight.float(), bias.float())
    for early_trigger in (False, True):
        for config in candidate_configs():
            out = launch(rms_norm(x, norm_weight, 1e-6), weight, bias, config, early_trigger)
            assert relative_error(out, expected) < 1e-2, (config, early_trigger)
    dense_gemv(rms_norm(x, norm_weight, 1e-6), weight, bias)  # tuned outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [dense_gemv(rms_norm(x, norm_weight, 1e-6), weight, bias) for _ in range(10)]
    for _ in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = F.linear(rms_norm(x, norm_weight, 1e-6).float(), weight.float(),
                            bias.float())
        for out in outs:
            assert relative_error(out, expected) < 1e-2
