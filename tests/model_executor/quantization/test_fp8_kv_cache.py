"""``--kv-cache-dtype fp8`` through ``octavo.LLM`` (CPU backend, torch attention path).

The cache holds float8 e4m3: one byte per value, so the same KV memory holds twice the blocks
of a bf16 cache (four times float32's). Greedy outputs must equal the unquantized cache's and
logprobs stay within what e4m3's 3 mantissa bits cost (``LOGPROB_ATOL``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import make_llm
from tests.helpers.tiny import make_tiny_model

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "1 2 3 4 5 6 7"]
NUM_TOKENS = 12
# e4m3 rounds K/V by up to 1/16 relative; on the tiny model logprobs move by < 0.05.
LOGPROB_ATOL = 0.05
KV_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_cache_holds_more_blocks_in_the_same_memory(tiny_folder, dtype, ratio):
    dense = make_llm(tiny_folder, dtype=dtype, kv_cache_memory_bytes=KV_BYTES)
    fp8 = make_llm(tiny_folder, dtype=dtype, kv_cache_memory_bytes=KV_BYTES,
                   kv_cache_dtype="fp8")
    assert fp8.llm_engine.num_blocks == ratio * dense.llm_engine.num_blocks
    caches = fp8.llm_engine.engine_core.executor.worker.model_runner.kv_caches
    assert caches and all(c.dtype == torch.float8_e4m3fn for c in caches)


def test_fp8_cache_greedy_equals_the_unquantized_cache(tiny_folder):
    """Same greedy tokens with logprobs within ``LOGPROB_ATOL``, up to where the tiny random
    model meets a near tie: there the token fp8 picked must be one the unquantized run scored
    within ``LOGPROB_ATOL`` of its own choice (the rest of that sequence is then a different
    text and is not compared)."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    dense = make_llm(tiny_folder).generate(PROMPTS, params)
    fp8 = make_llm(tiny_folder, kv_cache_dtype="fp8_e4m3").generate(PROMPTS, params)
    worst, compared = 0.0, 0
    for ours, reference in zip(fp8, dense):
        mine, theirs = ours.outputs[0], reference.outputs[0]
        for step, (token, want) in enumerate(zip(mine.token_ids, theirs.token_ids)):
            if token != want:  # a near tie of the unquantized model
                gap = theirs.logprobs[step][want].logprob - theirs.logprobs[step][token].logprob
                assert gap < LOGPROB_ATOL, (step, gap)
                break
            worst = max(worst, abs(mine.logprobs[step][token].logprob
                                   - theirs.logprobs[step][token].logprob))
            compared += 1
    assert compared >= len(PROMPTS) * NUM_TOKENS // 2
    assert 0.0 < worst < LOGPROB_ATOL, worst  # quantized (not equal) yet close


def test_bad_kv_cache_dtype_is_refused_with_the_choices(tiny_folder):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        make_llm(tiny_folder, kv_cache_dtype="int8")
