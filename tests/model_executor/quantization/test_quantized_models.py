"""Quantized checkpoints end to end through ``octavo.LLM`` against Hugging Face transformers.

A tiny random Llama is quantized into each format (``octavo.testing.quantized_models``, the
exact tensors and ``quantization_config`` the tools write). The reference is transformers on
the same weights: loading the fp8 checkpoint itself (its FineGrainedFP8 path dequantizes on a
machine without a GPU) and, where transformers needs libraries that run only on GPUs (AWQ,
GPTQ) or that are not installed (compressed-tensors), a dense checkpoint holding the
dequantized weights. GGUF files go through transformers' GGUF loader, which dequantizes.

Octavo keeps every weight quantized (fp8 in e4m3, int4 packed, GGUF in blocks) and dequantizes
inside each matmul; in float32 its greedy ids must equal the reference's and its logprobs be
within ``LOGPROB_ATOL``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from octavo.sampling_params import SamplingParams
from octavo.testing.quantized_models import (
    write_awq,
    write_compressed_tensors_fp8,
    write_dense,
    write_fp8,
    write_gptq,
)

from tests.helpers.engine import make_llm
from tests.helpers.tiny import make_tiny_model

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]
NUM_TOKENS = 8
# Same dequantized weights on both sides: only the order of float32 sums differs.
LOGPROB_ATOL = 2e-4


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 128 / intermediate 256: whole fp8 blocks of 32 and int4 groups of 32.
    return make_tiny_model(tmp_path_factory.mktemp("dense"), "llama", hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def hf_greedy(folder: Path, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=NUM_TOKENS, pad_token_id=2, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt_ids):].tolist()
    return generated, torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def assert_matches_hf(quantized: Path, reference: Path, **llm_kwargs) -> str:
    """Greedy ids and logprobs of Octavo on ``quantized`` equal transformers' on
    ``reference``; returns the quantization method the engine resolved."""
    llm = make_llm(quantized, **llm_kwargs)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        completion = output.outputs[0]
        expected_ids, expected_logprobs = hf_greedy(reference, list(output.prompt_token_ids))
        assert list(completion.token_ids) == expected_ids
        for step, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            got = logprobs[token].logprob
            want = float(expected_logprobs[step, token])
            assert abs(got - want) <= LOGPROB_ATOL, (step, got, want)
    return llm.llm_engine.config.model_config.quantization


@pytest.mark.parametrize("scheme", ["tensor-inv", "block"])
def test_fp8_checkpoint_matches_transformers_loading_it(dense_folder, tmp_path, scheme):
    folder = tmp_path / "fp8"
    write_fp8(dense_folder, folder, scheme=scheme, block=(32, 32))
    # transformers reads the fp8 checkpoint itself (dequantizing it without a GPU).
    assert assert_matches_hf(folder, folder) == "fp8"


def test_fp8_per_tensor_weight_scale_names(dense_folder, tmp_path):
    folder = tmp_path / "fp8"
    dense = write_fp8(dense_folder, folder, scheme="tensor")  # vLLM's weight_scale naming
    assert assert_matches_hf(folder, write_dense(dense_folder, tmp_path / "ref", dense)) == "fp8"


@pytest.mark.parametrize("per_channel", [True, False])
def test_compressed_tensors_fp8(dense_folder, tmp_path, per_channel):
    folder = tmp_path / "ct"
    dense = write_compressed_tensors_fp8(dense_folder, folder, per_channel=per_channel)
    reference = write_dense(dense_folder, tmp_path / "ref", dense)
    assert assert_matches_hf(folder, reference) == "compressed-tensors"


def test_fp8_quantized_while_loading_a_dense_checkpoint(dense_folder, tmp_path):
    """``--quantization fp8`` on bf16/fp32 weights: per-channel scales, within fp8 rounding of
    the dense model (greedy choices must be the dense model's near-ties at most)."""
    llm = make_llm(dense_folder, quantization="fp8")
    model = llm.llm_engine.engine_core.executor.worker.model  # uniproc: the one rank
    layer = model.model.layers["0"].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (
        layer.output_size,)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    ours = llm.generate(PROMPTS, params)
    for output in ours:
        _, dense_logprobs = hf_greedy(dense_folder, list(output.prompt_token_ids))
        first = output.outputs[0]
        # e4m3 keeps 3 mantissa bits: per-step logprobs move by a few hundredths at most here.
        got = first.logprobs[0][first.token_ids[0]].logprob
        assert abs(got - float(dense_logprobs[0, first.token_ids[0]])) < 0.1


@pytest.mark.parametrize("desc_act, sym", [(False, True), (True, False)])
def test_gptq_checkpoint(dense_folder, tmp_path, desc_act, sym):
    folder = tmp_path / "gptq"
    dense = write_gptq(dense_folder, folder, group_size=32, desc_act=desc_act, sym=sym)
    reference = write_dense(dense_folder, tmp_path / "ref", dense)
    assert assert_matches_hf(folder, reference) == "gptq"


def test_awq_checkpoint(dense_folder, tmp_path):
    folder = tmp_path / "awq"
    dense = write_awq(dense_folder, folder, group_size=32)
    reference = write_dense(dense_folder, tmp_path / "ref", dense)
    assert assert_matches_hf(folder, reference) == "awq"


def test_int4_checkpoint_on_two_tensor_parallel_ranks_matches_one(dense_folder, tmp_path):
    """The layouts cut packed tensors per rank: TP=2 (gloo, two processes) equals TP=1."""
    folder = tmp_path / "gptq"
    write_gptq(dense_folder, folder, group_size=32, desc_act=True, sym=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in make_llm(folder).generate(PROMPTS, params)]
    two = make_llm(folder, device="cpu", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == one
    finally:
        two.llm_engine.shutdown()  # ends the worker processes (else they outlive the test)


class TorchNormThenInt4:
    """A backend's ``int4_matmul_add_rms_norm`` in torch (the norm as ``RMSNorm`` computes it,
    then the dequantized matmul), counting its calls: what a kernel that takes the norm into
    the GEMV must give."""

    def __init__(self) -> None:
        self.calls = 0

    def int4_matmul_add_rms_norm(self, x, residual, norm_weight, eps, qweight, scales, zeros,
                                 group_size, g_idx):
        from octavo.kernels.int4 import int4_linear_reference

        self.calls += 1
        s = x + residual
        s32 = s.float()
        normed = norm_weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
                                ).to(s.dtype)
        return int4_linear_reference(normed, qweight, scales, zeros, group_size, g_idx), s


def test_the_norm_inside_the_int4_matmul_gives_the_same_tokens(dense_folder, tmp_path,
                                                                monkeypatch):
    """``LinearMethod.apply_add_rms_norm`` through the decoder layer: with a backend that
    takes each norm into the int4 projection after it (qkv past the first layer, gate_up),
    decoding gives the same greedy tokens and logprobs as the norm then the matmul."""
    from octavo.model_executor.layers.quantization import registry

    folder = tmp_path / "gptq"
    write_gptq(dense_folder, folder, group_size=32, desc_act=False, sym=True)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=1)
    plain = make_llm(folder).generate(PROMPTS, params)
    kernels = TorchNormThenInt4()
    create = registry.create_quantization_config
    monkeypatch.setattr(registry, "create_quantization_config",
                        lambda *args, **kw: setattr(config := create(*args, **kw), "kernels",
                                                    kernels) or config)
    fused = make_llm(folder).generate(PROMPTS, params)
    # each step (the prompts' prefill, then NUM_TOKENS - 1 decode steps of both): every
    # layer's gate_up norm and every qkv norm but the first layer's
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert kernels.calls >= NUM_TOKENS * (2 * layers - 1)
    for a, b in zip(plain, fused):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for step, token in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[step][token].logprob
                       - b.outputs[0].logprobs[step][token].logprob) <= LOGPROB_ATOL
