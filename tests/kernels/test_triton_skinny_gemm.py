"""The small-M ("skinny") quantized kernels (fp8 w8a16, int4 GPTQ/AWQ, GGUF blocks) against
plain torch references (dequantize, then matmul: ``fp8_linear_reference``,
``int4_linear_reference``, ``gguf_matmul_reference``).

On the CPU they run under the Triton interpreter at small shapes, through both code paths
(one row: elementwise sums; 2-16 rows: ``tl.dot``), with and without split-K; ``gpu`` tests
take Llama-3-8B's layer shapes with tuned configs, check CUDA-graph capture and the layers'
dispatch (which kernel runs for how many rows).
"""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch
from octavo.kernels.fp8 import fp8_linear, fp8_linear_reference, quantize_fp8_per_channel
from octavo.kernels.gguf import GGUF_BLOCKS, gguf_matmul_reference
from octavo.kernels.int4 import dequantize_int4, int4_linear, int4_linear_reference, to_panels
from octavo.kernels.skinny import SMALL_M_MAX, m_bucket, use_small_m_kernel
from octavo.kernels.triton import fp8_gemv as fp8_gemv_module
from octavo.kernels.triton import int4_gemv as int4_gemv_module
from octavo.kernels.triton import skinny_gemm as skinny_gemm_module
from octavo.kernels.triton.fp8_gemv import fp8_gemv
from octavo.kernels.triton.gguf_gemv import gguf_gemv
from octavo.kernels.triton.int4_gemv import fit_block_k, int4_gemv, slice_rows
from octavo.kernels.triton.skinny_gemm import (
    CONFIG_DIR,
    SkinnyConfig,
    SkinnyOutput,
    SkinnyTuner,
    SplitKWorkspace,
    chip_of,
    choose_split_k,
    config_table_path,
    find_config_tables,
    k_per_split,
    merge_config_tables,
    read_config_table,
    tune_key,
)

from tests.kernels.conftest import DEVICE, TOLERANCES
from tests.kernels.test_triton_quant_gemm import gguf_weight, int4_weight

# Interpreter configs: one program per block of outputs, and K split over 3 programs (atomics).
SMALL_CONFIGS = [SkinnyConfig(block_n=16, block_k=32, split_k=1),
                 SkinnyConfig(block_n=32, block_k=64, split_k=3)]
# fp8's one-row loop with each step's products summed over 16-input runs first
SUM_RUNS_CONFIG = SkinnyConfig(block_n=16, block_k=64, split_k=2, sum_runs=True)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference over the largest reference value (sums over K: relative to the
    output's scale)."""
    return ((out.float() - expected.float()).abs().max()
            / expected.float().abs().max().clamp(min=1e-6)).item()


def fp8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    weight[:, :3] *= 40  # outliers: per-channel scales differ from row to row
    return quantize_fp8_per_channel(weight)


def test_small_m_threshold_and_buckets():
    assert SMALL_M_MAX == 16
    assert [use_small_m_kernel(m) for m in (0, 1, 16, 17)] == [False, True, True, False]
    assert [m_bucket(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="1 to 16"):
        m_bucket(17)


@pytest.mark.parametrize("config", [*SMALL_CONFIGS, SUM_RUNS_CONFIG],
                         ids=["split1", "split3", "sum-runs"])
@pytest.mark.parametrize("m", [1, 3, 16], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# neither a multiple of the blocks (masked edges), or whole blocks and steps (no masks)
@pytest.mark.parametrize("n, k", [(40, 200), (64, 256)], ids=["tails", "whole"])
def test_fp8_gemv_matches_the_dequantized_reference(config, m, dtype, n, k):
    weight, scale = fp8_weight(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    out = fp8_gemv(x, weight, scale, config)
    expected = fp8_linear_reference(x, weight, scale, None)  # activations unquantized
    assert out.shape == (m, n) and out.dtype == dtype
    assert relative_error(out, expected) < TOLERANCES[dtype][0]


def test_fp8_gemv_takes_a_per_tensor_scale_and_refuses_block_scales():
    weight, _ = fp8_weight(16, 64)
    x = torch.randn(2, 64).to(DEVICE)
    out = fp8_gemv(x, weight.to(DEVICE), torch.tensor(0.01, device=DEVICE))
    expected = fp8_linear_reference(x, weight.to(DEVICE), torch.full((16,), 0.01,
                                                                    device=DEVICE), None)
    assert relative_error(out, expected) < 1e-5
    with pytest.raises(ValueError, match="per-channel or per-tensor"):
        fp8_gemv(x, weight.to(DEVICE), torch.ones(1, 2, device=DEVICE))
    with pytest.raises(ValueError, match="e4m3"):
        fp8_gemv(x, weight.float().to(DEVICE), torch.ones(16, device=DEVICE))


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=["split1", "split3"])
@pytest.mark.parametrize("m", [1, 5, 16], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("sym, act_order", [(True, False), (False, False), (False, True)],
                         ids=["sym", "asym", "asym-act-order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int4_gemv_matches_the_dequantized_reference(config, m, sym, act_order, dtype):
    n, k, group_size = 40, 256, 32
    qweight, scales, zeros, g_idx = int4_weight(n, k, group_size, sym, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemv(*args, group_size, g, config)
    # float32 reference on the same (rounded) activations: the kernel dequantizes in float32
    expected = int4_linear_reference(args[0].float(), *args[1:], group_size, g)
    assert out.shape == (m, n) and out.dtype == dtype
    assert relative_error(out, expected) < TOLERANCES[dtype][0]


@pytest.mark.parametrize("config", SMALL_CONFIGS, ids=["split1", "split3"])
@pytest.mark.parametrize("m", [1, 5], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act-order"])
def test_int4_gemv_reads_panels_as_gptq_rows(config, m, act_order):
    """The same words in 32-output panels (``to_panels``): the same output, bit for bit, on
    every path (one row, ``tl.dot`` rows, act-order)."""
    n, k, group_size = 64, 256, 32
    qweight, scales, zeros, g_idx = int4_weight(n, k, group_size, False, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemv(*args, group_size, g, config)
    panels = to_panels(args[1])
    assert torch.equal(int4_gemv(args[0], panels, *args[2:], group_size, g, config), out)
    expected = int4_linear_reference(args[0].float(), *args[1:], group_size, g)
    assert relative_error(out, expected) < TOLERANCES[torch.bfloat16][0]


@pytest.mark.parametrize("m", [1, 4], ids=lambda m: f"m{m}")
def test_int4_gemv_one_group_over_all_inputs_and_steps_cut_to_groups(m):
    """group_size -1 (the whole K: 192 here) and a block_k that does not divide a group of 32
    (cut to 32): every step stays inside one group."""
    assert fit_block_k(128, 32, False) == 32 and fit_block_k(128, 192, False) == 64
    assert fit_block_k(128, 32, True) == 128
    for k, group_size in ((192, 192), (256, 32)):
        qweight, scales, zeros, _ = int4_weight(24, k, group_size, sym=False, act_order=False)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
        args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
        out = int4_gemv(*args, group_size, None, SkinnyConfig(block_n=16, block_k=128))
        expected = int4_linear_reference(*args, group_size)
        assert relative_error(out, expected) < TOLERANCES[torch.float32][0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_int4_gemv_one_row_slices_partial_groups_and_unaligned_x(dtype):
    """The one-row path's variants: a step loaded in two slices of eight word rows (block_n
    128), a last group and step cut short (K = 200, groups of 32: no ``EVEN_K``), a block of
    outputs past N (masked), and bfloat16 ``x`` that is not 4-byte aligned (loaded one by one
    instead of in pairs)."""
    assert slice_rows(128, 128, 4) == 8 and slice_rows(256, 128, 4) == 4
    assert slice_rows(16, 32, 4) == 4  # a whole step smaller than a slice
    for n, k, group_size, config in ((136, 256, 128, SkinnyConfig(128, 128, split_k=2)),
                                     (40, 200, 32, SkinnyConfig(32, 128, split_k=1))):
        qweight, scales, zeros, _ = int4_weight(n, k, group_size, sym=False, act_order=False)
        storage = torch.randn(k + 1, generator=torch.Generator().manual_seed(3)).to(dtype)
        for x in (storage[:k].view(1, k), storage[1:].view(1, k)):  # aligned, then not
            args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
            out = int4_gemv(*args, group_size, None, config)
            expected = int4_linear_reference(args[0].float(), *args[1:], group_size)
            assert relative_error(out, expected) < TOLERANCES[dtype][0]


def test_int4_gemv_one_row_error_within_the_bound_of_the_128_offset():
    """The one-row path sums ``x * (128 + q)`` in float32 and takes ``(128 + z) * sum(x)`` off
    once per step: partial sums up to 143 * sum|x| where the result is |q - z| * sum|x|. Worst
    case (recursive summation, unit roundoff u = 2^-24, chains of at most ``block_k + 2``
    terms for the products and for sum(x), then ``K / 8`` more additions of partial results):

        |error[n]| <= u * (2 * 143 * (block_k + 2) + 15 * (K / 8 + 8)) * sum_k |x[k] * s[k, n]|

    checked against a float64 reference on bfloat16-valued float32 inputs (exact products).
    The observed error is far below it: ~2^-22 of the same sum (a float32 matmul of the
    dequantized weight: ~2^-20), asserted below 2^-19."""
    n, k, group_size, block_k = 64, 512, 128, 128
    qweight, scales, zeros, _ = int4_weight(n, k, group_size, sym=False, act_order=False)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).bfloat16().float()
    x[0, :7] *= 50  # a few large activations, as in real layers
    out = int4_gemv(*[t.to(DEVICE) for t in (x, qweight, scales, zeros)], group_size, None,
                    SkinnyConfig(64, block_k, split_k=2)).cpu().double()
    weight = dequantize_int4(qweight, scales, zeros, group_size, None, torch.float64)
    expected = x.double() @ weight.T
    group_scales = scales.double().repeat_interleave(group_size, dim=0)  # [K, N]
    magnitude = (x.double().abs().T * group_scales).sum(dim=0)  # sum_k |x[k] * s[k, n]|
    bound = 2.0**-24 * (2 * 143 * (block_k + 2) + 15 * (k / 8 + 8)) * magnitude
    error = (out[0] - expected[0]).abs()
    assert (error <= bound).all(), (error / bound).max()
    assert (error <= 2.0**-19 * magnitude).all(), (error / magnitude).max()


def test_split_k_fills_the_target_programs_and_keeps_two_steps():
    cpu = torch.device("cpu")  # 8 programs wanted off the GPU
    assert choose_split_k(32, 1024, SkinnyConfig(16, 64), cpu) == 4  # 2 blocks of outputs
    assert choose_split_k(32, 128, SkinnyConfig(16, 64), cpu) == 1  # two steps only
    assert choose_split_k(32, 1024, SkinnyConfig(16, 64, split_k=3), cpu) == 3


@pytest.fixture
def fresh_workspace(monkeypatch):
    """A split-K workspace of this test's own (the kernels take the module's)."""
    workspace = SplitKWorkspace()
    monkeypatch.setattr(skinny_gemm_module, "SPLIT_K_WORKSPACE", workspace)
    return workspace


def test_split_k_sums_in_the_kernel_and_leaves_the_workspace_at_zero(fresh_workspace):
    """One-row launches of different shapes one after another share the workspace (a
    several-row launch between them adds into its own float32 output): each result is right
    and each leaves the sums and the arrival counts at zero for the next."""
    config = SkinnyConfig(block_n=16, block_k=32, split_k=3)
    for n, k, m in [(40, 200, 1), (72, 130, 1), (40, 200, 5), (24, 64, 1)]:
        weight, scale = (t.to(DEVICE) for t in fp8_weight(n, k, seed=n))
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
        out = fp8_gemv(x, weight, scale, config)
        assert out.dtype == x.dtype
        assert relative_error(out, fp8_linear_reference(x, weight, scale, None)) \
            < TOLERANCES[torch.float32][1]
        (sums, arrivals), = fresh_workspace.current.values()
        assert not sums.any() and not arrivals.any()
    assert sums.numel() == SplitKWorkspace.MIN_SUMS
    assert arrivals.numel() == SplitKWorkspace.MIN_BLOCKS


@pytest.mark.parametrize("m", [5, 16])
def test_split_k_of_several_rows_sums_in_the_kernel(fresh_workspace, m):
    """The several-row path of the in-kernel sum against the reference, the workspace left at
    zero."""
    weight, scale = (t.to(DEVICE) for t in fp8_weight(72, 130, seed=m))
    x = torch.randn(m, 130, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    out = fp8_gemv(x, weight, scale, SkinnyConfig(block_n=16, block_k=32, split_k=3))
    assert relative_error(out, fp8_linear_reference(x, weight, scale, None)) \
        < TOLERANCES[torch.float32][1]
    (sums, arrivals), = fresh_workspace.current.values()
    assert not sums.any() and not arrivals.any()


def test_split_k_during_capture_without_a_workspace_zeroes_and_casts(fresh_workspace,
                                                                      monkeypatch):
    """A workspace that would have to be allocated inside a graph capture is not: the launch
    adds into a zeroed float32 output and casts it, with the same sums."""
    config = SkinnyConfig(block_n=16, block_k=32, split_k=3)
    weight, scale = (t.to(DEVICE) for t in fp8_weight(40, 200))
    x = torch.randn(1, 200, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    monkeypatch.setattr(skinny_gemm_module, "capturing", lambda device: True)
    plan = SkinnyOutput.make(1, 40, 16, 3, torch.bfloat16, x.device)
    assert not plan.in_kernel_sum and plan.out.dtype == torch.float32
    assert fresh_workspace.current == {}
    without = [fp8_gemv(x.to(dtype), weight, scale, config)
               for dtype in (torch.float32, torch.bfloat16)]
    monkeypatch.setattr(skinny_gemm_module, "capturing", lambda device: False)
    with_workspace = [fp8_gemv(x.to(dtype), weight, scale, config)
                      for dtype in (torch.float32, torch.bfloat16)]
    assert fresh_workspace.current  # made outside the capture
    assert torch.equal(without[0], with_workspace[0])  # the interpreter adds in one order
    # bf16: the same float32 sums, rounded by torch in one path and by Triton in the other
    # (the interpreter's rounding may differ from torch's by one unit).
    assert with_workspace[1].dtype == without[1].dtype == torch.bfloat16
    assert relative_error(with_workspace[1], without[1]) < TOLERANCES[torch.bfloat16][1]


def test_split_k_of_every_row_count_plans_the_in_kernel_sum(fresh_workspace):
    for m in (1, 4, 16):
        plan = SkinnyOutput.make(m, 40, 16, 3, torch.bfloat16, torch.device(DEVICE))
        assert plan.in_kernel_sum and plan.out.dtype == torch.bfloat16
    plan = SkinnyOutput.make(4, 40, 16, 1, torch.bfloat16, torch.device(DEVICE))
    assert not plan.in_kernel_sum  # unsplit: stored directly


@pytest.mark.parametrize("block_k", [32, 64, 128])
@pytest.mark.parametrize("split_k", [0, 2, 3, 8, 16, 32])
def test_every_program_of_a_split_gets_inputs(block_k, split_k):
    """``choose_split_k`` cuts a split to the programs whose whole-step ranges start inside K
    (16 splits of 38 steps of 128 are 13 programs of 3 steps), and those cover K."""
    device = torch.device(DEVICE)
    for k in (96, 200, 608, 4096, 4864, 14336):
        split = choose_split_k(4096, k, SkinnyConfig(512, block_k, split_k), device)
        per = k_per_split(k, split, block_k)
        assert 1 <= split and (split - 1) * per < k <= split * per, (k, split, per)
        if split_k:
            assert split <= split_k


# Splits whose last programs would have no inputs: 19 steps of 32 in 8 splits of 3 steps are
# 7 programs (an 8th would have started past K).
EMPTY_TAIL = SkinnyConfig(block_n=32, block_k=32, split_k=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_row_kernels_with_a_split_past_k_match_their_references(fresh_workspace, dtype):
    """Regression: an empty program ran the one-row loops' first step (peeled to load before
    the PDL wait) past K and read ``x`` and group scales out of range: all-NaN outputs at
    Llama-3-8B's down_proj on an H200 with the tuner's auto split."""
    n, k = 32, 608
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    qweight, scales, zeros = (t.to(DEVICE) for t in int4_weight(n, k, 32, sym=False,
                                                                act_order=False)[:3])
    out = int4_gemv(x, qweight, scales, zeros, 32, None, EMPTY_TAIL)
    expected = int4_linear_reference(x.float(), qweight, scales, zeros, 32)
    assert relative_error(out, expected) < TOLERANCES[dtype][0]
    weight, scale = (t.to(DEVICE) for t in fp8_weight(n, k, seed=6))
    out = fp8_gemv(x, weight, scale, EMPTY_TAIL)
    assert relative_error(out, fp8_linear_reference(x, weight, scale, None)) \
        < TOLERANCES[dtype][0]
    blocks = gguf_weight("Q8_0", n, k, seed=6).to(DEVICE)
    out = gguf_gemv(x, blocks, "Q8_0", k, EMPTY_TAIL)
    assert relative_error(out, gguf_matmul_reference(x.float(), blocks, "Q8_0", k)) \
        < TOLERANCES[dtype][0]
    (sums, arrivals), = fresh_workspace.current.values()
    assert not sums.any() and not arrivals.any()


@pytest.mark.parametrize("n, k", [(40, 224), (32, 256)], ids=["tails", "whole"])
def test_one_row_kernels_with_pipelined_loads_match_their_references(n, k):
    """``SkinnyConfig.load_stages``: the one-row K loops as ``tl.range`` loops with later
    steps' loads issued ahead (on a GPU through shared memory; the interpreter runs them as
    plain loops), with masked tails and without; several steps per program."""
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = x.to(DEVICE)
    qweight, scales, zeros = (t.to(DEVICE) for t in int4_weight(n, k, 32, sym=False,
                                                                act_order=False)[:3])
    int4_config = SkinnyConfig(block_n=32, block_k=32, split_k=1, load_stages=3)
    out = int4_gemv(x, qweight, scales, zeros, 32, None, int4_config)
    expected = int4_linear_reference(x.float(), qweight, scales, zeros, 32)
    assert relative_error(out, expected) < TOLERANCES[torch.bfloat16][0]
    weight, scale = (t.to(DEVICE) for t in fp8_weight(n, k, seed=8))
    for config in (SkinnyConfig(block_n=16, block_k=32, split_k=2, load_stages=4),
                   SkinnyConfig(block_n=16, block_k=32, split_k=1, sum_runs=True,
                                load_stages=3)):
        out = fp8_gemv(x, weight, scale, config)
        assert relative_error(out, fp8_linear_reference(x, weight, scale, None)) \
            < TOLERANCES[torch.bfloat16][0], config


def test_split_k_workspace_grows_and_keeps_what_it_replaced(fresh_workspace):
    device = torch.device(DEVICE)
    first = fresh_workspace.get(device, 10, 3)
    assert fresh_workspace.get(device, SplitKWorkspace.MIN_SUMS, 3) is first
    grown = fresh_workspace.get(device, SplitKWorkspace.MIN_SUMS + 1, 3)
    assert grown[0].numel() == SplitKWorkspace.MIN_SUMS + 1
    assert grown[1].numel() == SplitKWorkspace.MIN_BLOCKS
    assert fresh_workspace.retired == [first]  # captured graphs may still point at it
    assert SkinnyOutput.make(1, 8, 16, 1, torch.float16, device).sums.dtype == torch.float16


def test_split_k_in_kernel_sum_can_be_switched_off(fresh_workspace, monkeypatch):
    monkeypatch.setenv("OCTAVO_SKINNY_IN_KERNEL_SUM", "0")
    skinny_gemm_module.in_kernel_sum.cache_clear()  # read once per process
    try:
        plan = SkinnyOutput.make(1, 40, 16, 3, torch.bfloat16, torch.device(DEVICE))
    finally:
        skinny_gemm_module.in_kernel_sum.cache_clear()
    assert not plan.in_kernel_sum and plan.out.dtype == torch.float32
    assert fresh_workspace.current == {}


def test_tuner_uses_the_default_off_the_gpu_and_keeps_what_it_chose():
    tuner = SkinnyTuner("test")
    default = SkinnyConfig(16, 64)
    cpu = torch.device("cpu")
    calls = []
    chosen = tuner.choose("k", cpu, default, [SkinnyConfig(32, 64)], lambda c: calls.append(c))
    assert chosen == default and calls == [] and tuner.best == {}
    tuner.best[("k", cpu)] = SkinnyConfig(32, 64)
    assert tuner.choose("k", cpu, default, [], calls.append) == SkinnyConfig(32, 64)


def test_tune_keys_spell_the_case_as_the_tables_do():
    assert tune_key(n=6144, k=4096, m=1, dtype=torch.bfloat16) == \
        "n=6144,k=4096,m=1,dtype=bfloat16"
    assert tune_key(group=128, act_order=False) == "group=128,act_order=False"


def test_tuner_takes_the_device_table_before_timing(monkeypatch):
    """A case in the GPU's table is used as is (no timing, also during capture); a case
    outside it falls back to timing, here off, so the default."""
    table_config = SkinnyConfig(64, 256, split_k=2, num_warps=8)
    monkeypatch.setattr(skinny_gemm_module, "interpreting", lambda: False)
    monkeypatch.setattr(skinny_gemm_module, "_device_table",
                        lambda index: {"t": {"n=8,k=64,m=1,dtype=bfloat16": table_config}})
    tuner = SkinnyTuner("t")
    tuner.enabled = False
    gpu = torch.device("cuda", 0)
    calls = []
    key = tune_key(n=8, k=64, m=1, dtype=torch.bfloat16)
    assert tuner.choose(key, gpu, SkinnyConfig(16, 64), [], calls.append) == table_config
    assert tuner.choose("n=8,k=64,m=2,dtype=bfloat16", gpu, SkinnyConfig(16, 64), [],
                        calls.append) == SkinnyConfig(16, 64)
    assert calls == [] and tuner.best == {(key, gpu): table_config}


def test_tuner_lookup_takes_the_table_else_the_default_and_never_times(monkeypatch):
    table_config = SkinnyConfig(32, 32, num_warps=16)
    monkeypatch.setattr(skinny_gemm_module, "interpreting", lambda: False)
    monkeypatch.setattr(skinny_gemm_module, "_device_table",
                        lambda index: {"t": {"n=8,k=64,m=1,dtype=bfloat16": table_config}})
    tuner = SkinnyTuner("t")  # enabled: choose would time a case the table lacks
    gpu, default = torch.device("cuda", 0), SkinnyConfig(16, 32)
    assert tuner.lookup("n=8,k=64,m=1,dtype=bfloat16", gpu, default) == table_config
    assert tuner.lookup("n=8,k=64,m=2,dtype=bfloat16", gpu, default) == default
    assert tuner.lookup("n=8,k=64,m=1,dtype=bfloat16", torch.device("cpu"), default) == default
    assert tuner.best[("n=8,k=64,m=2,dtype=bfloat16", gpu)] == default


def test_config_tables_round_trip_and_bad_files_name_themselves(tmp_path):
    path = tmp_path / "skinny_Some_GPU.json"
    path.write_text(json.dumps({"kernels": {"fp8_gemv": {"n=1,k=2,m=1,dtype=bfloat16": {
        "block_n": 32, "block_k": 256, "split_k": 0, "num_warps": 8, "num_stages": 2}}}}))
    assert read_config_table(path) == {
        "fp8_gemv": {"n=1,k=2,m=1,dtype=bfloat16": SkinnyConfig(32, 256, 0, 8, 2)}}
    # The one-row loops' trigger: early unless the case says late
    assert SkinnyConfig(32, 256).early_trigger
    path.write_text(json.dumps({"kernels": {"dense_gemv": {"n=1,k=2,m=1,dtype=bfloat16": {
        "block_n": 4, "block_k": 1024, "early_trigger": False}}}}))
    assert read_config_table(path)["dense_gemv"]["n=1,k=2,m=1,dtype=bfloat16"] == \
        SkinnyConfig(4, 1024, early_trigger=False)
    path.write_text('{"kernels": {"fp8_gemv": {"n=1": {"block_size": 3}}}}')
    with pytest.raises(ValueError, match="skinny_Some_GPU.json"):
        read_config_table(path)
    assert config_table_path("NVIDIA H100 80GB HBM3").name == \
        "skinny_NVIDIA_H100_80GB_HBM3.json"


def test_a_gpu_takes_its_own_table_then_those_of_the_same_chip(tmp_path):
    """Its own table first, then those recorded for the same compute capability and SM count
    (an H200 takes the H100's); none for another chip, nor one that records none."""
    hopper = {"compute_capability": "9.0", "multi_processor_count": 132}
    h100 = tmp_path / "skinny_NVIDIA_H100_80GB_HBM3.json"
    h100.write_text(json.dumps({"chip": hopper, "kernels": {}}))
    (tmp_path / "skinny_Unrecorded_GPU.json").write_text(json.dumps({"kernels": {}}))
    assert find_config_tables("NVIDIA H100 80GB HBM3", hopper, tmp_path) == [(h100, True)]
    assert find_config_tables("NVIDIA H200", hopper, tmp_path) == [(h100, False)]
    h100_pcie = {"compute_capability": "9.0", "multi_processor_count": 114}
    assert find_config_tables("NVIDIA H100 PCIe", h100_pcie, tmp_path) == []
    h200 = tmp_path / "skinny_NVIDIA_H200.json"
    h200.write_text(json.dumps({"chip": hopper, "kernels": {}}))
    assert find_config_tables("NVIDIA H200", hopper, tmp_path) == [(h200, True), (h100, False)]
    assert find_config_tables("NVIDIA H100 80GB HBM3", hopper, tmp_path) == \
        [(h100, True), (h200, False)]
    (tmp_path / "skinny_Broken.json").write_text("{")
    with pytest.raises(ValueError, match="skinny_Broken.json"):
        find_config_tables("NVIDIA A100-SXM4-80GB", {"compute_capability": "8.0",
                                                     "multi_processor_count": 108}, tmp_path)


def test_the_device_table_comes_from_the_folder_the_environment_names(tmp_path, monkeypatch):
    """``OCTAVO_SKINNY_CONFIG_DIR``: a fresh sweep's tables instead of the package's (an A/B
    run); unset, the package's."""
    hopper = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: hopper)
    (tmp_path / "skinny_NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps(
        {"chip": chip_of(hopper), "kernels": {"fp8_gemv": {"n=1,k=2,m=1,dtype=bfloat16": {
            "block_n": 16, "block_k": 1024, "sum_runs": True}}}}))
    skinny_gemm_module._device_table.cache_clear()
    try:
        monkeypatch.setenv("OCTAVO_SKINNY_CONFIG_DIR", str(tmp_path))
        assert skinny_gemm_module._device_table(0) == {
            "fp8_gemv": {"n=1,k=2,m=1,dtype=bfloat16": SkinnyConfig(16, 1024, sum_runs=True)}}
        skinny_gemm_module._device_table.cache_clear()
        monkeypatch.delenv("OCTAVO_SKINNY_CONFIG_DIR")
        shipped = read_config_table(CONFIG_DIR / "skinny_NVIDIA_H100_80GB_HBM3.json")
        assert skinny_gemm_module._device_table(0)["dense_gemv"] == shipped["dense_gemv"]
    finally:
        skinny_gemm_module._device_table.cache_clear()


def test_merged_tables_keep_the_first_config_of_a_case_and_every_other_case():
    own = {"dense_gemv": {"a": SkinnyConfig(4, 1024)}, "int4_gemv": {"b": SkinnyConfig(64, 128)}}
    mate = {"int4_gemv": {"b": SkinnyConfig(256, 32), "c": SkinnyConfig(128, 128)},
            "fp8_gemv": {"d": SkinnyConfig(16, 512)}}
    assert merge_config_tables([own, mate]) == {
        "dense_gemv": {"a": SkinnyConfig(4, 1024)},
        "int4_gemv": {"b": SkinnyConfig(64, 128), "c": SkinnyConfig(128, 128)},
        "fp8_gemv": {"d": SkinnyConfig(16, 512)}}
    assert merge_config_tables([]) == {}


def test_chip_of_reads_the_device_properties():
    properties = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    assert chip_of(properties) == {"compute_capability": "9.0", "multi_processor_count": 132}


def test_shipped_config_tables_record_their_chip():
    """So that GPUs of the same chip without a table of their own can find them."""
    for path in sorted(CONFIG_DIR.glob("skinny_*.json")):
        chip = json.loads(path.read_text())["chip"]
        assert set(chip) == {"compute_capability", "multi_processor_count"}, path


def test_shipped_config_tables_parse_and_name_known_kernels_and_cases():
    """Every table shipped with the package: readable, for the skinny kernels, each key a
    case those kernels look up (n, k, a row bucket, an activation dtype, ...)."""
    tables = sorted(CONFIG_DIR.glob("skinny_*.json"))
    for path in tables:
        for kernel, entries in read_config_table(path).items():
            # the CUDA backend's int4_mma_gemv reads its configs from the same tables
            assert kernel in {"fp8_gemv", "int4_gemv", "gguf_gemv", "dense_gemv",
                              "int4_mma_gemv"}, (path, kernel)
            for key in entries:
                fields = dict(field.split("=") for field in key.split(","))
                assert list(fields)[:4] == ["n", "k", "m", "dtype"], (path, key)
                assert int(fields["m"]) in (1, 2, 4, 8, 16), (path, key)


def test_layers_keep_the_reference_path_on_the_cpu():
    weight, scale = fp8_weight(16, 64)
    x = torch.randn(1, 64)
    assert torch.equal(fp8_linear(x, weight, scale, None),
                       fp8_linear_reference(x, weight, scale, None))
    qweight, scales, zeros, _ = int4_weight(16, 64, 32, sym=True, act_order=False)
    assert torch.equal(int4_linear(x, qweight, scales, zeros, 32),
                       int4_linear_reference(x, qweight, scales, zeros, 32))


# ---- full shapes on the GPU ----------------------------------------------------------------

# Llama-3-8B projections (N, K): fused qkv, o, gate_up, gate (or up) alone, down.
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (14336, 4096), (4096, 14336)]
# bf16 outputs over K up to 14336: the kernels sum in float32 in another order than the
# reference and round once; 1e-2 of the largest output is ~2.5 bf16 ulps.
GPU_RELATIVE_ERROR = 1e-2


@functools.cache
def full_size_int4(n: int, k: int, act_order: bool):
    """Llama-3-8B-sized int4 weights, quantized once on the CPU for every row count."""
    return int4_weight(n, k, 128, sym=False, act_order=act_order)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
@pytest.mark.parametrize("m", [1, 4, 16], ids=lambda m: f"m{m}")
def test_fp8_gemv_llama3_8b_shapes_on_gpu(n, k, m):
    weight, scale = fp8_weight(n, k)
    x = torch.randn(m, k).to(torch.bfloat16).cuda()
    weight, scale = weight.cuda(), scale.cuda()
    out = fp8_gemv(x, weight, scale)  # tuned on first use
    assert relative_error(out, fp8_linear_reference(x, weight, scale, None)) \
        < GPU_RELATIVE_ERROR


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
def test_fp8_gemv_one_row_every_config_after_a_norm_llama3_8b_shapes_on_gpu(n, k):
    """Every one-row launch config the tuner or a table may choose (16-input runs summed
    first or not, either PDL trigger), after the RMS norm that produces ``x`` (PDL: the
    weights are read before the norm is done), eagerly and replayed from a graph."""
    from octavo.kernels.triton.rmsnorm import rms_norm

    weight, scale = (t.cuda() for t in fp8_weight(n, k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).cuda()
    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    expected = fp8_linear_reference(rms_norm(x, norm_weight, 1e-6), weight, scale, None)
    configs = [fp8_gemv_module.default_config(n, k, 1),
               *fp8_gemv_module.candidate_configs(1)]
    for config in dict.fromkeys(configs):
        assert relative_error(fp8_gemv(rms_norm(x, norm_weight, 1e-6), weight, scale, config),
                              expected) < GPU_RELATIVE_ERROR, config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_gemv(rms_norm(x, norm_weight, 1e-6), weight, scale, config)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, expected) < GPU_RELATIVE_ERROR, config


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
@pytest.mark.parametrize("m", [1, 4, 16], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act-order"])
def test_int4_gemv_llama3_8b_shapes_on_gpu(n, k, m, act_order):
    qweight, scales, zeros, g_idx = full_size_int4(n, k, act_order)
    x = torch.randn(m, k).to(torch.bfloat16)
    args = [t.cuda() for t in (x, qweight, scales, zeros)]
    g = g_idx.cuda() if g_idx is not None else None
    out = int4_gemv(*args, 128, g)
    expected = int4_linear_reference(args[0].float(), *args[1:], 128, g)
    assert relative_error(out, expected) < GPU_RELATIVE_ERROR


# One-row int4 outputs against the float32 reference: ~2.5 ulps of the largest output.
ONE_ROW_RELATIVE_ERROR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act-order"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int4_gemv_one_row_every_config_llama3_8b_shapes_on_gpu(n, k, act_order, dtype):
    """The one-row paths at the 8B shapes, group 128: natural order (inline-PTX nibble
    unpacking) with every launch config the tuner may choose, act-order with the default."""
    qweight, scales, zeros, g_idx = full_size_int4(n, k, act_order)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = [t.cuda() for t in (x, qweight, scales, zeros)]
    g = g_idx.cuda() if g_idx is not None else None
    expected = int4_linear_reference(args[0].float(), *args[1:], 128, g)
    configs = [int4_gemv_module.default_config(n, k, 1)]
    if not act_order:
        configs += int4_gemv_module.candidate_configs(1)
    for config in dict.fromkeys(configs):
        out = int4_gemv(*args, 128, g, config)
        assert out.dtype == dtype
        assert relative_error(out, expected) < ONE_ROW_RELATIVE_ERROR[dtype], config


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int4_gemv_one_row_inline_asm_equals_the_plain_triton_unpacking_on_gpu(dtype,
                                                                               monkeypatch):
    """The inline PTX makes the same floats as the interpreter's plain-Triton bit algebra, and
    the sums run in the same order: bit-identical outputs (one program per output block, no
    atomics)."""
    qweight, scales, zeros, _ = full_size_int4(4096, 4096, False)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(6)).to(dtype)
    args = [t.cuda() for t in (x, qweight, scales, zeros)]
    config = SkinnyConfig(128, 128, split_k=1)
    with_asm = int4_gemv(*args, 128, None, config)
    monkeypatch.setattr(int4_gemv_module, "interpreting", lambda: True)  # NIBBLE_ASM off
    assert not int4_gemv_module.kernel_constexprs(args[0], 4096, 4096, 128, False, config,
                                                  1)["NIBBLE_ASM"]
    assert torch.equal(int4_gemv(*args, 128, None, config), with_asm)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4], ids=lambda m: f"m{m}")
def test_split_k_in_kernel_sums_stay_right_over_many_launches_and_replays_on_gpu(m):
    """On the GPU the programs of a split really race: 200 launches of 16-way splits at
    Llama-3-8B shapes, eagerly and replayed from one captured graph, each within the
    reference's tolerance, and the workspace back at zero after them (at four rows it failed
    8 of 10 runs on an H200 before ``store_skinny_output``'s barrier between reading the
    totals and zeroing them)."""
    assert SkinnyOutput.make(m, 4096, 64, 16, torch.bfloat16, torch.device("cuda")).in_kernel_sum
    config = SkinnyConfig(64, 128, split_k=16)
    qweight, scales, zeros, _ = (t.cuda() if t is not None else None
                                 for t in full_size_int4(4096, 4096, False))
    weight, scale = (t.cuda() for t in fp8_weight(4096, 14336))
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    x_long = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    expected = [int4_linear_reference(x.float(), qweight, scales, zeros, 128, None),
                fp8_linear_reference(x_long, weight, scale, None)]

    def both():
        return [int4_gemv(x, qweight, scales, zeros, 128, None, config),
                fp8_gemv(x_long, weight, scale, SkinnyConfig(16, 256, split_k=8))]

    for _ in range(100):
        for out, ref in zip(both(), expected):
            assert relative_error(out, ref) < GPU_RELATIVE_ERROR
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = both()
    for _ in range(100):
        graph.replay()
        for out, ref in zip(captured, expected):
            assert relative_error(out, ref) < GPU_RELATIVE_ERROR
    torch.cuda.synchronize()
    sums, arrivals = skinny_gemm_module.SPLIT_K_WORKSPACE.current[x.device]
    assert not sums.any() and not arrivals.any()


@pytest.mark.gpu
def test_skinny_kernels_capture_in_cuda_graphs_after_warm_up(monkeypatch):
    """Warm-up (eager) tunes; the captured graph replays the tuned kernels and gives the eager
    result. A shape first seen during capture and absent from the config table takes the
    default config (no timing there)."""
    weight, scale = (t.cuda() for t in fp8_weight(4096, 4096))
    qweight, scales, zeros, _ = (t.cuda() if t is not None else None
                                 for t in int4_weight(4096, 4096, 128, False, False))
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    eager = [fp8_gemv(x, weight, scale), int4_gemv(x, qweight, scales, zeros, 128)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [fp8_gemv(x, weight, scale), int4_gemv(x, qweight, scales, zeros, 128)]
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):  # split-K atomics add in any order: not bit-exact
        assert relative_error(a, b) < GPU_RELATIVE_ERROR
    fresh = SkinnyTuner("fresh")
    monkeypatch.setattr(skinny_gemm_module, "_device_table", lambda index: {})
    old, fp8_gemv_module.TUNER = fp8_gemv_module.TUNER, fresh
    try:
        y = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_gemv(y, weight, scale)
        graph.replay()
        torch.cuda.synchronize()
        assert fresh.best == {}  # nothing timed during capture
        assert relative_error(out, fp8_linear_reference(y, weight, scale, None)) \
            < GPU_RELATIVE_ERROR
    finally:
        fp8_gemv_module.TUNER = old


@pytest.mark.gpu
def test_layers_dispatch_small_m_to_the_skinny_kernels_on_gpu():
    """Up to SMALL_M_MAX rows: fp8 weights with unquantized activations (the w8a16 reference
    within bf16 rounding); more rows: torch._scaled_mm with fp8 activations (the reference
    that quantizes them); int4 at one row: the skinny kernel's result."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 kernels need compute capability 8.9+")
    weight, scale = (t.cuda() for t in fp8_weight(4096, 4096))
    for m in (1, SMALL_M_MAX):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        w8a16 = fp8_linear_reference(x, weight, scale, None)
        assert relative_error(fp8_linear(x, weight, scale, None), w8a16) < GPU_RELATIVE_ERROR
    x = torch.randn(SMALL_M_MAX + 1, 4096, device="cuda", dtype=torch.bfloat16)
    quantized = fp8_linear_reference(x, weight, scale, None, quantize_input=True)
    assert relative_error(fp8_linear(x, weight, scale, None), quantized) < GPU_RELATIVE_ERROR
    qweight, scales, zeros, _ = (t.cuda() if t is not None else None
                                 for t in int4_weight(4096, 4096, 128, False, False))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert relative_error(int4_linear(x, qweight, scales, zeros, 128),
                          int4_gemv(x, qweight, scales, zeros, 128)) < 1e-3


# ---- GGUF ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
@pytest.mark.parametrize("m", [1, 5], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("config", [SkinnyConfig(16, 64, split_k=1),
                                    SkinnyConfig(16, 32, split_k=3)], ids=["split1", "split3"])
def test_gguf_gemv_matches_the_reference(qtype, m, config):
    n, k = 24, 512
    blocks = gguf_weight(qtype, n, k).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = gguf_gemv(x, blocks, qtype, k, config)
    expected = gguf_matmul_reference(x, blocks, qtype, k)
    assert out.shape == (m, n)
    assert relative_error(out, expected) < TOLERANCES[torch.float32][0]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
@pytest.mark.parametrize("m", [1, 4, 16], ids=lambda m: f"m{m}")
def test_gguf_gemv_llama3_8b_shape_on_gpu(qtype, m):
    n, k = 4096, 14336  # down_proj
    blocks = gguf_weight(qtype, n, k).to("cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = gguf_gemv(x, blocks, qtype, k)
    expected = gguf_matmul_reference(x.float(), blocks, qtype, k)
    assert relative_error(out, expected) < GPU_RELATIVE_ERROR
