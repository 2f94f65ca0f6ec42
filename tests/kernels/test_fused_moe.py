"""The fused MoE Triton kernel and the CPU path against the plain-loop reference.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py) at tiny
shapes: several expert counts, top-k 1/2/8, token counts that are not multiples of the row
block, experts that receive no token, reduction and output sizes that are not multiples of
the tiles. Tests marked ``gpu`` use Qwen3-30B-A3B's layer shape (128 experts, top 8, hidden
2048, expert intermediate 768) in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.triton.fused_moe import (
    MoELaunchConfig,
    default_moe_config,
    fused_moe,
    max_padded_rows,
    moe_align_block_size,
)
from octavo.model_executor.layers.fused_moe import (
    FusedMoE,
    fused_moe_native,
    fused_moe_reference,
    select_experts,
)

from tests.kernels.conftest import DEVICE, HAS_CUDA

# (atol, rtol) against the float32 reference; outputs are O(1).
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
}
# Small tiles so the tiny shapes still take several row, column and reduction steps.
TINY_CONFIG = MoELaunchConfig(block_m=16, block_n=16, block_k=16, group_m=2)


def make_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
             dtype: torch.dtype, seed: int = 0, device: str = DEVICE, unused: int = 0):
    """Random ``x, w13, w2`` and softmax top-k routing; the last ``unused`` experts get no
    token (their router logits are -inf)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * intermediate, hidden, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, intermediate, scale=intermediate**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if unused:
        logits[:, num_experts - unused:] = float("-inf")
    weights, ids = select_experts(logits.to(device), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# --- alignment --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m",
                         [(1, 4, 2, 16), (37, 8, 2, 16), (5, 16, 8, 4), (64, 3, 1, 32)])
def test_align_groups_every_assignment_once_by_expert(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    sorted_ids, block_expert, num_padded = moe_align_block_size(ids, num_experts, block_m)
    num_assignments = num_tokens * top_k
    assert sorted_ids.shape == (max_padded_rows(num_assignments, num_experts, block_m),)
    assert block_expert.shape == (sorted_ids.shape[0] // block_m,)
    total = int(num_padded)
    assert total % block_m == 0 and total <= sorted_ids.shape[0]
    valid = sorted_ids[sorted_ids < num_assignments]
    assert sorted(valid.tolist()) == list(range(num_assignments))  # each assignment once
    assert bool((sorted_ids[total:] == num_assignments).all())  # nothing past the total
    flat = ids.flatten()
    for block in range(total // block_m):
        rows = sorted_ids[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_assignments].long()
        assert rows.numel() > 0, "no block is all padding"
        assert bool((flat[rows] == block_expert[block]).all())
        assert rows.tolist() == sorted(rows.tolist())  # token order within an expert
    used = sorted(set(flat.tolist()))
    counts = torch.bincount(flat, minlength=num_experts)
    assert total == sum(-(-int(counts[e]) // block_m) * block_m for e in used)


# --- routing ----------------------------------------------------------------------------------


def test_select_experts_with_and_without_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 2.5, 0.0, 0.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, ids = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights[0], probs[0, [1, 2]] / probs[0, [1, 2]].sum())
    assert weights.dtype == torch.float32


# --- the kernel and the CPU path against the reference -----------------------------------------

# (num_tokens, num_experts, top_k, hidden, intermediate, experts left unused)
CASES = [
    (1, 4, 1, 32, 16, 0),
    (5, 4, 2, 40, 24, 0),  # hidden and intermediate not multiples of 16
    (37, 8, 2, 32, 32, 3),  # 37 tokens (not a multiple of 16), 3 experts never chosen
    (9, 16, 8, 48, 16, 6),  # top-8 of 10 live experts
    (3, 1, 1, 32, 48, 0),  # a single expert
]
CASE_IDS = [f"T{c[0]}-E{c[1]}-k{c[2]}-H{c[3]}-I{c[4]}-unused{c[5]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_kernel_matches_reference(case, dtype):
    num_tokens, num_experts, top_k, hidden, intermediate, unused = case
    x, w13, w2, weights, ids = make_moe(num_tokens, num_experts, top_k, hidden, intermediate,
                                        dtype, unused=unused)
    if unused:
        assert int(ids.max()) < num_experts - unused  # the test covers empty experts
    out = fused_moe(x, w13, w2, weights, ids, TINY_CONFIG)
    assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_path_matches_reference(case, dtype):
    num_tokens, num_experts, top_k, hidden, intermediate, unused = case
    x, w13, w2, weights, ids = make_moe(num_tokens, num_experts, top_k, hidden, intermediate,
                                        dtype, device="cpu", unused=unused)
    out = fused_moe_native(x, w13, w2, weights, ids)
    assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), dtype)


def test_kernel_agrees_with_native_path_to_the_rounding():
    """Same roundings in the same places: in float32 the two agree far inside the reference
    tolerance, in bfloat16 to about one unit in the last place."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        x, w13, w2, weights, ids = make_moe(21, 8, 2, 32, 32, dtype, seed=5)
        kernel = fused_moe(x, w13, w2, weights, ids, TINY_CONFIG).cpu()
        native = fused_moe_native(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
        torch.testing.assert_close(kernel.float(), native.float(), atol=tol, rtol=tol)


def test_default_config_runs_and_zero_tokens():
    x, w13, w2, weights, ids = make_moe(3, 4, 2, 32, 16, torch.float32)
    out = fused_moe(x, w13, w2, weights, ids)  # default_moe_config: 16-row tiles
    assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), torch.float32)
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


def test_bad_shapes_are_refused():
    x, w13, w2, weights, ids = make_moe(3, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="shapes do not agree"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="one dtype"):
        fused_moe(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="power of two"):
        MoELaunchConfig(block_m=24)


def test_default_configs_by_rows_per_expert():
    assert default_moe_config(1, 128, 8).block_m == 16  # decode
    assert default_moe_config(2048, 128, 8).block_m == 64  # prefill chunk


# --- the layer --------------------------------------------------------------------------------


def test_layer_uses_the_native_path_on_cpu_tensors(monkeypatch):
    from octavo.distributed.parallel_state import ParallelState
    from octavo.model_executor.layers import fused_moe as layer_module

    calls = []
    real = layer_module.fused_moe_native
    monkeypatch.setattr(layer_module, "fused_moe_native",
                        lambda *args: calls.append(1) or real(*args))
    layer = FusedMoE(4, 2, 32, 16, ParallelState.single(), renormalize=False)
    x, w13, w2, _, _ = make_moe(6, 4, 2, 32, 16, torch.float32, device="cpu")
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    weights, ids = select_experts(logits, 2, renormalize=False)
    out = layer(x, logits)
    assert calls == [1]
    assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), torch.float32)


# --- full shapes on the GPU -------------------------------------------------------------------

# Qwen3-30B-A3B's MoE layer: 128 experts, top 8, hidden 2048, expert intermediate 768.
QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 2048])
def test_kernel_at_qwen3_30b_a3b_shape_bf16(num_tokens):
    shape = QWEN3_30B_A3B
    x, w13, w2, weights, ids = make_moe(num_tokens, shape["num_experts"], shape["top_k"],
                                        shape["hidden"], shape["intermediate"], torch.bfloat16)
    out = fused_moe(x, w13, w2, weights, ids)
    assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_kernel_in_a_cuda_graph_equals_eager():
    """The forward is CUDA-graph safe (no host sync, static shapes): a replay with new routing
    gives what an eager call gives."""
    shape = QWEN3_30B_A3B
    x, w13, w2, weights, ids = make_moe(64, shape["num_experts"], shape["top_k"],
                                        shape["hidden"], shape["intermediate"], torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        captured = fused_moe(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    _, _, _, new_weights, new_ids = make_moe(64, shape["num_experts"], shape["top_k"],
                                             shape["hidden"], shape["intermediate"],
                                             torch.bfloat16, seed=9)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, fused_moe(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_layer_dispatches_to_the_kernel_on_cuda(monkeypatch):
    from octavo.distributed.parallel_state import ParallelState
    from octavo.model_executor.layers import fused_moe as layer_module

    monkeypatch.setattr(layer_module, "fused_moe_native",
                        lambda *args: pytest.fail("CUDA tensors took the native path"))
    with torch.device("cuda"):
        layer = FusedMoE(8, 2, 256, 128, ParallelState.single(), renormalize=True)
    x, w13, w2, _, _ = make_moe(33, 8, 2, 256, 128, torch.float32)
    with torch.no_grad():
        layer.w13_weight.copy_(w13)
        layer.w2_weight.copy_(w2)
    logits = torch.randn(33, 8, device="cuda")
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert_close(layer(x, logits), fused_moe_reference(x, w13, w2, weights, ids), torch.float32)
