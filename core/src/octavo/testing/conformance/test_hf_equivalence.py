"""End to end through ``octavo.LLM`` on the backend, against Hugging Face transformers.

Tiny random-weight Llama (untied embeddings) and Qwen3 (q/k norms, tied embeddings), in the
plan's dtype. float32: greedy token ids identical to ``generate(do_sample=False)``, logprobs
close, the same top tokens. 16-bit: every greedy choice is the reference's argmax within the
dtype's tolerance and every logprob is close (``octavo.testing.compare``).
"""

from __future__ import annotations

import pytest

from octavo.testing.compare import (
    assert_greedy_choices,
    assert_logprobs_close,
    assert_top_tokens,
)
from octavo.testing.engine_checks import assert_no_leaks, greedy, prompts_of_lengths
from octavo.testing.engines import open_llm
from octavo.testing.hf_reference import HFReference

ARCHS = ("llama", "qwen3")
NUM_TOKENS = 12
PROMPTS = prompts_of_lengths([4, 11, 19, 37], seed=11)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, octavo_plan, octavo_tiny_model):
    folder = octavo_tiny_model(request.param)
    with open_llm(octavo_plan, folder) as llm:
        yield llm, HFReference(folder, octavo_plan.model_dtype)


def test_greedy_ids_and_logprobs_match_hf(pair, octavo_plan):
    llm, hf = pair
    dtype, k = octavo_plan.model_dtype, octavo_plan.num_logprobs
    outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS, logprobs=k), use_tqdm=False)
    assert_no_leaks(llm)
    for n, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
        what = f"prompt {n} ({len(prompt)} tokens)"
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        assert output.prompt_token_ids == prompt
        assert len(ids) == NUM_TOKENS and completion.finish_reason == "length", what
        if octavo_plan.exact:
            assert ids == hf.greedy(prompt, NUM_TOKENS), f"{what}: greedy ids differ from HF"
        reference = hf.next_token_logprobs(prompt + ids)[len(prompt) - 1 : -1]
        assert_greedy_choices(reference, ids, dtype, what)
        assert len(completion.logprobs) == NUM_TOKENS
        assert_logprobs_close(completion.logprobs, reference, dtype, what)
        for i, (position, token_id) in enumerate(zip(completion.logprobs, ids)):
            assert_top_tokens(position, reference[i], token_id, k, dtype, f"{what}, position {i}")


def test_prompt_logprobs_match_hf(pair, octavo_plan):
    llm, hf = pair
    params = greedy(1, prompt_logprobs=min(3, octavo_plan.num_logprobs))
    if not octavo_plan.prompt_logprobs:
        # The backend declares it cannot compute them: the engine must refuse the request.
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert_no_leaks(llm)
        return
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_no_leaks(llm)
    for n, (prompt, output) in enumerate(zip(PROMPTS, outputs)):
        assert len(output.prompt_logprobs) == len(prompt)
        assert output.prompt_logprobs[0] is None
        reference = hf.next_token_logprobs(prompt)[:-1]  # row p predicts prompt token p + 1
        for i, position in enumerate(output.prompt_logprobs[1:]):
            assert prompt[i + 1] in position, f"prompt {n}: position {i + 1} lacks its token"
        assert_logprobs_close(output.prompt_logprobs[1:], reference, octavo_plan.model_dtype,
                              f"prompt {n} prompt logprobs")
