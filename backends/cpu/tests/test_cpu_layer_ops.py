"""The CPU backend's C++ layer ops (``csrc/layer_ops.cpp``) against the layers' torch code.

RMSNorm (alone and fused with the residual add), rotary embedding and SiLU-and-mul, each
called through the layer with the kernels registered for CPU tensors
(``octavo.kernels.host_layer_kernels``) and compared with the layer's ``forward_native``:
float32 within float rounding (the norm's sum of squares is added in another order), bfloat16
and float16 within one rounding of the dtype; one token (decode) and enough tokens to run on
several threads; strided query/key views as the attention layer passes them. The bound GGUF
matmul (``GGUFQuantKernels.gguf_matmul_bound``) gives exactly what the unbound one does.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
from octavo.kernels.host_layer_kernels import host_layer_kernels, register_host_layer_kernels
from octavo.model_executor.layers import RMSNorm, SiluAndMul
from octavo.model_executor.layers.rotary import RopeParameters, RotaryEmbedding
from octavo_cpu import layers, quant
from test_cpu_quant import make_blocks


@pytest.fixture
def registered():
    kernels = layers.layer_kernels()
    if kernels is None:
        if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"):
            pytest.fail("the C++ kernels did not build on x86-64 Linux (see the warning above)")
        pytest.skip("no C++ kernels on this platform")
    before = host_layer_kernels("cpu")
    register_host_layer_kernels("cpu", kernels)
    yield kernels
    register_host_layer_kernels("cpu", before)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6),
             torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
             torch.float16: dict(rtol=2e-3, atol=1e-3)}
DTYPES = list(TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_rms_norm_matches_torch(registered, dtype, tokens):
    torch.manual_seed(tokens)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576) * 0.5 + 1)
    x = (torch.randn(tokens, 576) * 3).to(dtype)
    residual = torch.randn(tokens, 576).to(dtype)
    x_copy, residual_copy = x.clone(), residual.clone()
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), norm.forward_native(x), **TOLERANCE[dtype])
        y, summed = norm(x, residual)
        y_ref, summed_ref = norm.forward_native(x, residual)
    torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)  # one rounding, both sides
    torch.testing.assert_close(y, y_ref, **TOLERANCE[dtype])
    assert torch.equal(x, x_copy) and torch.equal(residual, residual_copy)  # inputs untouched


def test_rms_norm_strided_and_3d(registered):
    """Per-head norms (Qwen3's q/k norm) get [tokens, heads, head_dim] views of the QKV output."""
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    with torch.inference_mode():
        torch.testing.assert_close(norm(q), norm.forward_native(q), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 4, 40])
def test_rotary_matches_torch(registered, dtype, tokens):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(64, 2048, RopeParameters("default", 100000.0))
    heads, kv_heads = 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 64).to(dtype)
    q, k, _ = qkv.split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)
    q, k = q.view(tokens, heads, 64), k.view(tokens, kv_heads, 64)  # strided views
    positions = torch.randint(0, 2048, (tokens,))
    before = qkv.clone()
    with torch.inference_mode():
        q_out, k_out = rope(positions, q, k)
        q_ref, k_ref = rope.forward_native(positions, q, k)
    # Same products and sums in the same dtype: equal bit for bit.
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    assert torch.equal(qkv, before)


def test_rotary_rejects_positions_outside_the_table(registered):
    rope = RotaryEmbedding(64, 16, RopeParameters("default", 10000.0))
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table of 16 positions"):
        rope(torch.tensor([16]), q, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 33])
def test_silu_and_mul_matches_torch(registered, dtype, tokens):
    torch.manual_seed(tokens)
    act = SiluAndMul()
    x = (torch.randn(tokens, 2 * 1536) * 4).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(act(x), act.forward_native(x), **TOLERANCE[dtype])


def test_silu_and_mul_vector_path_at_the_ends_of_the_range(registered):
    # float32 takes an AVX2 path with its own exp (clamped to [-87, 88]), 8 values at a time,
    # and the scalar code for the tail: values far out on both sides, zeros, and a tail of 3.
    gate = torch.tensor([-200.0, -90.0, -87.5, -20.0, -1e-30, 0.0, 1e-30, 3.0,
                         20.0, 87.5, 90.0, 200.0, -5.0, 0.5, 1.0, -0.25, 7.0, -3.0, 0.125])
    x = torch.cat([gate, torch.linspace(-2.0, 2.0, gate.numel())]).unsqueeze(0)
    act = SiluAndMul()
    with torch.inference_mode():
        torch.testing.assert_close(act(x), act.forward_native(x), rtol=1e-5, atol=1e-6)


def test_nothing_registered_runs_torch():
    """Without registered kernels (OCTAVO_CPU_LAYER_KERNELS=0) the layers take forward_native."""
    before = host_layer_kernels("cpu")
    register_host_layer_kernels("cpu", None)
    try:
        x = torch.randn(2, 8)
        assert torch.equal(SiluAndMul()(x), SiluAndMul().forward_native(x))
    finally:
        register_host_layer_kernels("cpu", before)


def test_register_follows_the_env_switch(monkeypatch, registered):
    before = host_layer_kernels("cpu")
    try:
        monkeypatch.setenv("OCTAVO_CPU_LAYER_KERNELS", "0")
        assert layers.register_layer_kernels() is False
        assert host_layer_kernels("cpu") is None
        monkeypatch.setenv("OCTAVO_CPU_LAYER_KERNELS", "1")
        assert layers.register_layer_kernels() is True
        assert host_layer_kernels("cpu") is not None
    finally:
        register_host_layer_kernels("cpu", before)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_bound_gguf_matmul_equals_unbound(registered, qtype):
    torch.manual_seed(0)
    blocks = make_blocks(qtype, 40, 64)
    kernels = quant.GGUFQuantKernels()
    matmul = kernels.gguf_matmul_bound(blocks, qtype, 64)
    for x in (torch.randn(1, 64), torch.randn(5, 64), torch.randn(2, 3, 64),
              torch.randn(3, 64).to(torch.bfloat16), torch.randn(64, 3).t()):
        assert torch.equal(matmul(x), kernels.gguf_matmul(x, blocks, qtype, 64))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_equal_with_and_without_layer_ops(registered, tmp_path, monkeypatch, arch):
    """The engine's greedy tokens and logprobs (float32, tiny random models; Qwen3 adds the
    per-head q/k norms) with the C++ layer ops and with the layers' torch code."""
    from octavo import LLM, SamplingParams
    from octavo.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path / arch, arch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5, 17, 42, 9, 3]}, {"prompt_token_ids": list(range(30, 70))}]
    outputs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("OCTAVO_CPU_LAYER_KERNELS", switch)
        llm = LLM(model=str(folder), kv_cache_memory_bytes=8 * 2**20, cpu_threads=1)
        assert (host_layer_kernels("cpu") is not None) == (switch == "1")
        outputs[switch] = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
    for on, off in zip(outputs["1"], outputs["0"]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        for lp_on, lp_off in zip(on.outputs[0].logprobs, off.outputs[0].logprobs):
            for token, entry in lp_off.items():
                assert lp_on[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
