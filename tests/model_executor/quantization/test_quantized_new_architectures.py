"""Quantized weights and the fp8 KV cache on Gemma 2/3 and Phi-3 (``octavo.LLM``, CPU).

Their linear layers are built through the same quantization methods as Llama's: an fp8
checkpoint of each must give transformers' greedy ids and logprobs on the same checkpoint (as
``test_quantized_models`` checks for Llama), Phi-3's fused ``qkv_proj``/``gate_up_proj`` with one
scale for the fused tensor. ``--quantization fp8`` quantizes a dense checkpoint of each while
loading. The fp8 KV cache on windowed models (Mistral's window, Gemma 2's window and logit soft
cap) stays within e4m3 rounding of the unquantized cache, the tokens before the window
included in neither.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.sampling_params import SamplingParams
from octavo.testing.quantized_models import write_fp8

from tests.helpers.engine import make_llm
from tests.helpers.tiny import make_tiny_model
from tests.model_executor.quantization.test_quantized_models import (
    NUM_TOKENS,
    PROMPTS,
    assert_matches_hf,
    hf_greedy,
)

ARCHS = ["gemma2", "gemma3", "phi3"]
# e4m3 rounds K/V by up to 1/16 relative. Under a window of 8 a token's output averages over
# at most 8 values, so the rounding averages out less than over a whole context: the tiny
# window-8 Mistral moves by 0.06 where the same model without a window moves by 0.03 (0.05 is
# test_fp8_kv_cache's bound). The attention itself is checked exactly against the reference
# (backends/cpu/tests/test_cpu_fp8_kv_cache.py).
KV_LOGPROB_ATOL = 0.1


@pytest.fixture(scope="module")
def dense_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch), arch)
            for arch in ARCHS + ["mistral-swa"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_checkpoint_matches_transformers_loading_it(dense_folders, tmp_path, arch):
    folder = tmp_path / "fp8"
    write_fp8(dense_folders[arch], folder, scheme="tensor-inv")
    assert assert_matches_hf(folder, folder) == "fp8"


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_quantized_while_loading_a_dense_checkpoint(dense_folders, arch):
    """Every projection of every layer in e4m3 (the fused ones of Phi-3 included), and the first
    step's logprob within fp8 rounding of transformers on the dense weights."""
    llm = make_llm(dense_folders[arch], quantization="fp8")
    model = llm.llm_engine.engine_core.executor.worker.model  # uniproc: the one rank
    for layer in model.model.layers.values():
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):
            assert proj.weight.dtype == torch.float8_e4m3fn
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    for output in llm.generate(PROMPTS, params):
        _, dense_logprobs = hf_greedy(dense_folders[arch], list(output.prompt_token_ids))
        first = output.outputs[0]
        got = first.logprobs[0][first.token_ids[0]].logprob
        assert abs(got - float(dense_logprobs[0, first.token_ids[0]])) < 0.1


@pytest.mark.parametrize("arch", ["mistral-swa", "gemma2"])
def test_fp8_kv_cache_on_a_windowed_model_stays_close_to_the_unquantized_cache(
        dense_folders, arch):
    """Greedy ids equal to the unquantized cache's up to a near tie of the tiny model, and
    logprobs within ``KV_LOGPROB_ATOL``; sequences run well past the window (8) on 4-token
    blocks, so blocks behind every layer's window are freed while the requests run."""
    prompts = ["The capital of France is Paris, and the capital of Italy is",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    dense_llm = make_llm(dense_folders[arch], block_size=4)
    fp8_llm = make_llm(dense_folders[arch], block_size=4, kv_cache_dtype="fp8")
    config = fp8_llm.llm_engine.config
    assert config.cache_config.cache_dtype == "fp8"
    assert any(w is not None for w in config.model_config.sliding_windows)
    caches = fp8_llm.llm_engine.engine_core.executor.worker.model_runner.kv_caches
    assert all(c.dtype == torch.float8_e4m3fn for c in caches)
    dense = dense_llm.generate(prompts, params)
    fp8 = fp8_llm.generate(prompts, params)
    worst, compared = 0.0, 0
    for ours, reference in zip(fp8, dense):
        assert len(ours.prompt_token_ids) > 8  # past the window
        mine, theirs = ours.outputs[0], reference.outputs[0]
        for step, (token, want) in enumerate(zip(mine.token_ids, theirs.token_ids)):
            if token != want:  # a near tie of the unquantized model
                gap = theirs.logprobs[step][want].logprob - theirs.logprobs[step][token].logprob
                assert gap < KV_LOGPROB_ATOL, (step, gap)
                break
            worst = max(worst, abs(mine.logprobs[step][token].logprob
                                   - theirs.logprobs[step][token].logprob))
            compared += 1
    assert compared >= len(prompts) * 16 // 2
    assert 0.0 < worst < KV_LOGPROB_ATOL, worst  # quantized (not equal) yet close
