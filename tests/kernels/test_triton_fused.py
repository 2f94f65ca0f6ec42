"""Fused elementwise kernels (RMSNorm, rotary, SiLU-and-mul) against the layers' torch paths.

The kernels repeat the layers' eager arithmetic rounding for rounding, so: the rotary kernel
and the residual sum must match exactly in every dtype; RMSNorm and SiLU may differ in the last
float32 bit (sum order, ``rsqrt``/``exp``), i.e. by up to two units in the last place of the
output dtype (``TOLERANCES``). Under the CPU interpreter, bf16 rounding is emulated by the
kernels (``emulate_bf16_rounding``), so the exact checks hold there too.

Tests marked ``gpu`` use the real Qwen2-0.5B shapes and also check the layers' CUDA dispatch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from octavo.kernels.triton import apply_rotary, fused_add_rms_norm, rms_norm, silu_and_mul
from octavo.model_executor.layers import RMSNorm, RopeParameters, RotaryEmbedding, SiluAndMul

from tests.kernels.conftest import DEVICE, DTYPES

# (atol, rtol): about two units in the last place of each dtype.
TOLERANCES = {
    torch.float32: (1e-6, 1e-6),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# Positions around and far beyond 1024 (the tables below hold 4096).
POSITIONS = [0, 1, 2, 511, 1023, 1024, 1025, 2047, 3000, 4095]
MAX_POSITIONS = 4096


def assert_close(actual: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    """Same dtype and shape, values within ``TOLERANCES`` (or bit-equal when ``exact``)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_norm(hidden_size: int, dtype: torch.dtype, seed: int = 0, device: str = DEVICE) -> RMSNorm:
    """An ``RMSNorm`` with a random (not all-ones) weight."""
    norm = RMSNorm(hidden_size, eps=1e-6)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden_size, generator=gen))
    return norm.to(device=device, dtype=dtype)


def randn(*shape: int, dtype: torch.dtype, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)


def fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=2):
    """``q, k, v`` as strided views of one ``[num_tokens, (h + 2 * kv) * head_dim]`` tensor, the
    way ``LlamaAttention`` splits its QKV projection; also returns that tensor."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
        qkv,
    )


def make_rope(head_dim: int, device: str = DEVICE) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, MAX_POSITIONS, RopeParameters("default", 10000.0)).to(device)


# --- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden_size", [896, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_layer(dtype, hidden_size):
    norm = make_norm(hidden_size, dtype)
    x = randn(7, hidden_size, dtype=dtype, scale=3.0)
    residual = randn(7, hidden_size, dtype=dtype, seed=3)

    assert_close(rms_norm(x, norm.weight, norm.eps), norm.forward_native(x))
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    expected_out, expected_residual = norm.forward_native(x, residual)
    assert_close(new_residual, expected_residual, exact=True)  # one rounded add
    assert_close(out, expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_strided_and_batched_rows(dtype):
    # Per-head norm (Qwen3's q_norm) over a strided view of a fused QKV output.
    q, k, _, _ = fused_qkv_views(5, 3, 1, 64, dtype)
    assert not q.is_contiguous()
    norm = make_norm(64, dtype)
    assert_close(rms_norm(q, norm.weight, norm.eps), norm.forward_native(q))
    assert_close(rms_norm(k, norm.weight, norm.eps), norm.forward_native(k))
    # 1-D and 4-D inputs.
    x = randn(2, 3, 4, 64, dtype=dtype)
    assert_close(rms_norm(x, norm.weight, norm.eps), norm.forward_native(x))
    assert_close(rms_norm(x[0, 0, 0], norm.weight, norm.eps), norm.forward_native(x[0, 0, 0]))


def test_rms_norm_mixed_dtypes_promote_like_torch():
    norm = make_norm(80, torch.float32)  # float32 weight, bf16 activations
    x = randn(4, 80, dtype=torch.bfloat16)
    residual = randn(4, 80, dtype=torch.float32, seed=3)
    assert_close(rms_norm(x, norm.weight, norm.eps), norm.forward_native(x))
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    expected_out, expected_residual = norm.forward_native(x, residual)
    assert_close(new_residual, expected_residual, exact=True)
    assert_close(out, expected_out)


def test_rms_norm_leaves_inputs_and_handles_no_rows():
    norm = make_norm(80, torch.float32)
    x, residual = randn(3, 80, dtype=torch.float32), randn(3, 80, dtype=torch.float32, seed=3)
    x_before, residual_before = x.clone(), residual.clone()
    fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    empty = torch.empty(0, 80, device=DEVICE)
    assert rms_norm(empty, norm.weight, norm.eps).shape == (0, 80)
    out, summed = fused_add_rms_norm(empty, empty, norm.weight, norm.eps)
    assert out.shape == summed.shape == (0, 80)


def test_rms_norm_rejects_bad_inputs():
    weight = torch.ones(80, device=DEVICE)
    x = torch.zeros(3, 80, device=DEVICE)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, weight[:64], 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        fused_add_rms_norm(x, x[:2], weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rms_norm(torch.zeros(80, 3, device=DEVICE).t(), weight, 1e-6)


# --- rotary -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (3, 1, 80), (20, 20, 32)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_layer(dtype, num_heads, num_kv_heads, head_dim):
    # (20, 20): more heads than one program rotates, query and key both split in blocks.
    num_tokens = len(POSITIONS)
    q, k, _, _ = fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    rope = make_rope(head_dim)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    q_out, k_out = apply_rotary(positions, q, k, rope.cos_sin_cache)
    q_ref, k_ref = rope.forward_native(positions, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_close(q_out, q_ref, exact=True)
    assert_close(k_out, k_ref, exact=True)


def test_rotary_in_place_writes_only_query_and_key():
    q, k, v, qkv = fused_qkv_views(len(POSITIONS), 3, 1, 80, torch.bfloat16)
    rope = make_rope(80)
    positions = torch.tensor(POSITIONS, device=DEVICE, dtype=torch.int32)
    q_ref, k_ref = rope.forward_native(positions.long(), q, k)
    v_before = v.clone()
    q_out, k_out = apply_rotary(positions, q, k, rope.cos_sin_cache, inplace=True)
    assert q_out.data_ptr() == qkv.data_ptr() and k_out is k
    assert_close(q, q_ref, exact=True)
    assert_close(k, k_ref, exact=True)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partial_rotary_through_the_layer(dtype):
    """A rope rotating 3/4 of each head with a scaled table (longrope): the layer's Triton
    path equals its torch path, and the last quarter passes through unchanged."""
    params = RopeParameters("longrope", 10000.0, factor=8.0, original_max_position_embeddings=64,
                            partial_rotary_factor=0.75, short_factor=(1.0,) * 24,
                            long_factor=tuple(1.0 + i / 8 for i in range(24)),
                            max_position_embeddings=MAX_POSITIONS)
    rope = RotaryEmbedding(64, MAX_POSITIONS, params).to(DEVICE)
    assert rope.rotary_dim == 48
    q, k, _, _ = fused_qkv_views(len(POSITIONS), 4, 2, 64, dtype)
    positions = torch.tensor(POSITIONS, device=DEVICE)
    q_out, k_out = rope.forward_triton(apply_rotary, positions, q, k)
    q_ref, k_ref = rope.forward_native(positions, q, k)
    assert_close(q_out, q_ref, exact=True)
    assert_close(k_out, k_ref, exact=True)
    assert torch.equal(q_out[..., 48:], q[..., 48:])


def test_rotary_handles_no_tokens_and_rejects_bad_inputs():
    rope = make_rope(64)
    q, k = torch.empty(0, 2, 64, device=DEVICE), torch.empty(0, 1, 64, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q_out, k_out = apply_rotary(positions, q, k, rope.cos_sin_cache)
    assert q_out.shape == (0, 2, 64) and k_out.shape == (0, 1, 64)
    q, k = torch.zeros(3, 2, 64, device=DEVICE), torch.zeros(3, 1, 64, device=DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="key shape"):
        apply_rotary(positions, q, k[:, :, :32], rope.cos_sin_cache)
    with pytest.raises(ValueError, match="positions shape"):
        apply_rotary(positions[:2], q, k, rope.cos_sin_cache)
    with pytest.raises(ValueError, match="cos_sin_cache shape"):
        apply_rotary(positions, q, k, rope.cos_sin_cache[:, :32])


# --- SiLU and mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("d", [80, 1500])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_layer(dtype, d):
    # 1500: two column blocks, the second partial. Scale 4 reaches silu's flat negative tail.
    x = randn(6, 2 * d, dtype=dtype, scale=4.0)
    assert_close(silu_and_mul(x), SiluAndMul().forward_native(x))


def test_silu_and_mul_strided_and_batched_rows():
    wide = randn(5, 2 * 80 + 16, dtype=torch.bfloat16)
    x = wide[:, : 2 * 80]  # strided rows
    assert_close(silu_and_mul(x), SiluAndMul().forward_native(x))
    x3 = randn(2, 3, 2 * 80, dtype=torch.float16)
    assert_close(silu_and_mul(x3), SiluAndMul().forward_native(x3))
    assert silu_and_mul(torch.empty(0, 160, device=DEVICE)).shape == (0, 80)
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))


# --- dispatch ---------------------------------------------------------------------------------


def test_cpu_layers_never_call_kernels(monkeypatch):
    """CPU tensors stay on the torch path even where Triton is importable."""
    import octavo.kernels.host_layer_kernels as host_kernels
    import octavo.kernels.triton.activation as activation_kernels
    import octavo.kernels.triton.rmsnorm as rmsnorm_kernels
    import octavo.kernels.triton.rotary as rotary_kernels

    def fail(*args, **kwargs):
        raise AssertionError("a Triton kernel was called for CPU tensors")

    for module, name in [
        (rmsnorm_kernels, "rms_norm"),
        (rmsnorm_kernels, "fused_add_rms_norm"),
        (rotary_kernels, "apply_rotary"),
        (activation_kernels, "silu_and_mul"),
    ]:
        monkeypatch.setattr(module, name, fail)
    # No host backend's ops either (a CPU engine started earlier in this process registers the
    # CPU backend's C++ ops; test_cpu_layer_ops.py checks those).
    monkeypatch.setattr(host_kernels, "_registered", {})
    norm, rope = make_norm(64, torch.float32, device="cpu"), make_rope(64, device="cpu")
    x = torch.randn(3, 64)
    assert torch.equal(norm(x), norm.forward_native(x))
    assert torch.equal(norm(x, x)[0], norm.forward_native(x, x)[0])
    q, k, positions = torch.randn(3, 2, 64), torch.randn(3, 1, 64), torch.tensor([0, 5, 9])
    assert torch.equal(rope(positions, q, k)[0], rope.forward_native(positions, q, k)[0])
    assert torch.equal(SiluAndMul()(x), SiluAndMul().forward_native(x))


def test_layers_import_and_run_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from octavo.kernels.triton_support import optional_triton_kernels\n"
        "from octavo.model_executor.layers import rmsnorm\n"
        "assert all(optional_triton_kernels(m) is None for m in ('rmsnorm', 'rotary', 'activation'))\n"
        "print(rmsnorm.RMSNorm(8)(torch.ones(2, 8)).sum().item())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert abs(float(result.stdout) - 16.0) < 1e-3


# --- GPU: real Qwen2-0.5B shapes, layer dispatch, CUDA graphs ---------------------------------

QWEN = {"hidden": 896, "num_heads": 14, "num_kv_heads": 2, "head_dim": 64, "inter": 4864}
GPU_TOKENS = 256


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_layers_dispatch_matches_cpu_path(dtype):
    from octavo.kernels.triton_support import optional_triton_kernels

    for name in ("activation", "rmsnorm", "rotary"):  # CUDA tensors really take Triton
        assert optional_triton_kernels(name) is not None, name
    torch.manual_seed(0)
    norm_cpu = make_norm(QWEN["hidden"], dtype, device="cpu")
    norm_gpu = make_norm(QWEN["hidden"], dtype, device="cuda")
    rope_cpu = make_rope(QWEN["head_dim"], device="cpu")
    rope_gpu = make_rope(QWEN["head_dim"], device="cpu").to("cuda")  # same table bits
    act = SiluAndMul()
    x = torch.randn(GPU_TOKENS, QWEN["hidden"]).to(dtype)
    residual = torch.randn(GPU_TOKENS, QWEN["hidden"]).to(dtype)
    gate_up = (4 * torch.randn(GPU_TOKENS, 2 * QWEN["inter"])).to(dtype)
    positions = torch.randint(0, MAX_POSITIONS, (GPU_TOKENS,))
    q_gpu, k_gpu, _, _ = fused_qkv_views(  # strided views of one CUDA tensor
        GPU_TOKENS, QWEN["num_heads"], QWEN["num_kv_heads"], QWEN["head_dim"], dtype
    )
    q, k = q_gpu.cpu(), k_gpu.cpu()

    # Layer on CUDA (Triton dispatch) vs the same layer's CPU path.
    assert_close(norm_gpu(x.cuda()).cpu(), norm_cpu(x))
    out, summed = norm_gpu(x.cuda(), residual.cuda())
    expected_out, expected_summed = norm_cpu(x, residual)
    assert_close(summed.cpu(), expected_summed, exact=True)
    assert_close(out.cpu(), expected_out)
    q_out, k_out = rope_gpu(positions.cuda(), q_gpu, k_gpu)
    q_ref, k_ref = rope_cpu(positions, q, k)
    assert_close(q_out.cpu(), q_ref)
    assert_close(k_out.cpu(), k_ref)
    assert_close(act(gate_up.cuda()).cpu(), act(gate_up))
    # Kernels vs the torch path on the same GPU.
    assert_close(norm_gpu(x.cuda()), norm_gpu.forward_native(x.cuda()))
    q_native, _ = rope_gpu.forward_native(positions.cuda(), q_gpu, k_gpu)
    assert_close(q_out, q_native)
    assert_close(act(gate_up.cuda()), act.forward_native(gate_up.cuda()))


@pytest.mark.gpu
def test_gpu_kernels_capture_in_cuda_graph():
    torch.manual_seed(0)
    dtype = torch.bfloat16
    norm = make_norm(QWEN["hidden"], dtype, device="cuda")
    rope = make_rope(QWEN["head_dim"], device="cuda")
    x = torch.randn(GPU_TOKENS, QWEN["hidden"], device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    gate_up = torch.randn(GPU_TOKENS, 2 * QWEN["inter"], device="cuda", dtype=dtype)
    positions = torch.randint(0, MAX_POSITIONS, (GPU_TOKENS,), device="cuda")
    q = torch.randn(GPU_TOKENS, QWEN["num_heads"], QWEN["head_dim"], device="cuda", dtype=dtype)
    k = torch.randn(GPU_TOKENS, QWEN["num_kv_heads"], QWEN["head_dim"], device="cuda", dtype=dtype)

    def step():
        out, summed = norm(x, residual)
        q_out, k_out = rope(positions, q, k)
        return norm(out), summed, q_out, k_out, SiluAndMul()(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for tensor in (x, residual, gate_up, q, k):  # new inputs, then replay
        tensor.copy_(torch.randn_like(tensor))
    positions.copy_(torch.randint(0, MAX_POSITIONS, (GPU_TOKENS,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for got, expected in zip(captured, step()):
        assert_close(got, expected, exact=True)
