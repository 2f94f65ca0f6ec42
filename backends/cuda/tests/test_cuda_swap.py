"""Preemption by swapping on the GPU (pinned host pool, non-blocking copies): greedy tokens and
logprobs equal with swap, recompute and no preemption; all device and host blocks free after;
n > 1 completions sharing their prompt's blocks and beam search against transformers on CUDA."""

from __future__ import annotations

import pytest
import torch
from octavo import LLM
from octavo.sampling_params import BeamSearchParams, SamplingParams
from octavo.testing.engine_checks import assert_no_leaks, random_prompts

from tests.helpers.tiny import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

PROMPTS = random_prompts(16, 10, 60, seed=3)
TINY_POOL = {"block_size": 16, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def run(llm):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512)
    try:
        return run(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_and_recompute_equal_no_preemption(model_dir, reference, mode,
                                                async_scheduling) -> None:
    llm = LLM(str(model_dir), device="cuda", dtype="float32", preemption_mode=mode,
              swap_space=0.05, async_scheduling=async_scheduling, **TINY_POOL)
    try:
        got = run(llm)
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, reference):
            assert tokens == want_tokens
            for pos, want in zip(logprobs, want_logprobs):
                for token_id, value in pos.items():
                    assert abs(value - want[token_id]) < 1e-3
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions > 0
        assert (stats.num_preemptions_swap > 0) == (mode == "swap")
        manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        assert manager.num_free_host_blocks == manager.num_host_blocks
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_shared_prompt_blocks_and_beam_search_on_cuda(model_dir) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(model_dir), device="cuda", dtype="float32", enable_prefix_caching=False,
              num_gpu_blocks_override=512)
    try:
        prompt = PROMPTS[0]
        params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
        assert_no_leaks(llm)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
        result = llm.beam_search({"prompt_token_ids": prompt},
                                 BeamSearchParams(beam_width=4, max_tokens=12))[0]
        ref = hf.generate(torch.tensor([prompt], device="cuda"), num_beams=4,
                          num_return_sequences=4, max_new_tokens=12, do_sample=False,
                          early_stopping=False, pad_token_id=0)
        assert [s.tokens[len(prompt):] for s in result.sequences] == \
            ref[:, len(prompt):].tolist()
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
