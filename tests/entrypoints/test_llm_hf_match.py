"""``octavo.LLM`` against Hugging Face transformers on the same weights, through the public API.

Every tiny architecture: greedy token ids equal ``generate(do_sample=False)`` for a batch of
prompts, and the returned logprobs / prompt logprobs equal ``log_softmax`` of HF's logits.
The real SmolLM2 GGUF (slow): greedy output equals transformers' on the same file (within a
near-tie where the CPU backend keeps the weights quantized).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import TINY_ARCHS, assert_no_leaks, greedy, make_llm, token_ids

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "Caf\u00e9 cr\u00e8me and \u65e5\u672c",
]
NUM_TOKENS = 20
LOGPROB_ATOL = 1e-4


class HFReference:
    """Transformers' model on a tiny folder, with EOS turned off so lengths match ignore_eos."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None

    def ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    @torch.inference_mode()
    def greedy(self, prompt: str, num_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy token ids and the log-softmax of the raw logits at each generated position."""
        input_ids = torch.tensor([self.ids(prompt)])
        out = self.model.generate(
            input_ids, do_sample=False, max_new_tokens=num_tokens, pad_token_id=2,
            output_logits=True, return_dict_in_generate=True,
        )
        generated = out.sequences[0, input_ids.shape[1]:].tolist()
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [num_tokens, vocab]
        return generated, logprobs

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: str) -> torch.Tensor:
        """[len - 1, vocab] log-probabilities of prompt tokens 1.. given what precedes them."""
        logits = self.model(torch.tensor([self.ids(prompt)])).logits[0, :-1]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def pair(request: pytest.FixtureRequest, tiny_model_factory: Callable[[str], Path]):
    folder = tiny_model_factory(request.param)
    llm = make_llm(folder, num_gpu_blocks_override=64)
    yield llm, HFReference(folder)
    llm.llm_engine.shutdown()


def assert_position_logprobs(position: dict, reference: torch.Tensor, chosen: int, k: int) -> None:
    """One position: the chosen token plus the top ``k``, each close to HF's value and rank."""
    top = torch.topk(reference, k)
    expected_ids = set(top.indices.tolist()) | {chosen}
    assert set(position) == expected_ids
    for token_id, logprob in position.items():
        assert math.isclose(logprob.logprob, reference[token_id].item(), abs_tol=LOGPROB_ATOL), (
            token_id, logprob.logprob, reference[token_id].item(),
        )
    expected_rank = 1 + int((reference > reference[chosen]).sum())
    assert position[chosen].rank == expected_rank


def test_greedy_and_logprobs_match_hf(pair) -> None:
    llm, hf = pair
    outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS, logprobs=5), use_tqdm=False)
    assert_no_leaks(llm)
    for prompt, output in zip(PROMPTS, outputs):
        expected_ids, expected_logprobs = hf.greedy(prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert output.prompt_token_ids == hf.ids(prompt)
        assert completion.token_ids == expected_ids, prompt
        assert completion.finish_reason == "length"
        assert len(completion.logprobs) == NUM_TOKENS
        for i, (position, token_id) in enumerate(zip(completion.logprobs, expected_ids)):
            assert_position_logprobs(position, expected_logprobs[i], token_id, 5)
            assert position[token_id].rank == 1  # greedy took the most likely token
        cumulative = sum(expected_logprobs[i, t].item() for i, t in enumerate(expected_ids))
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=NUM_TOKENS * 1e-4)


def test_prompt_logprobs_match_hf(pair) -> None:
    llm, hf = pair
    params = greedy(2, prompt_logprobs=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_no_leaks(llm)
    for prompt, output in zip(PROMPTS, outputs):
        ids = hf.ids(prompt)
        reference = hf.prompt_logprobs(prompt)
        assert len(output.prompt_logprobs) == len(ids)
        assert output.prompt_logprobs[0] is None
        for position, target, expected in zip(output.prompt_logprobs[1:], ids[1:], reference):
            assert_position_logprobs(position, expected, target, 3)


def test_sampled_logprobs_are_the_raw_distribution(pair) -> None:
    """Logprobs of sampled tokens ignore temperature (vLLM's default): still HF's log_softmax."""
    llm, hf = pair
    prompt = PROMPTS[0]
    out = llm.generate(prompt, SamplingParams(temperature=1.5, seed=3, max_tokens=6, logprobs=0,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([hf.ids(prompt) + out.token_ids])
    with torch.inference_mode():
        logits = hf.model(ids).logits[0, -len(out.token_ids) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, (position, token_id) in enumerate(zip(out.logprobs, out.token_ids)):
        assert set(position) == {token_id}
        assert position[token_id].logprob == pytest.approx(reference[i, token_id].item(),
                                                           abs=LOGPROB_ATOL)


# --- the real SmolLM2-135M-Instruct GGUF (loaded once per session, see tests/conftest.py) ---

GGUF_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
]
GGUF_TOKENS = 24


# Where the weights stay in their GGUF blocks on the CPU backend's kernels (#18), activations
# are rounded to int8, so a greedy pick may differ from HF's float32 one at a near-tie: each of
# Octavo's tokens must then be within this many nats of HF's best on the same prefix.
GGUF_NEAR_TIE = 0.5


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_hf(smollm2_llm, smollm2_hf) -> None:
    from octavo.model_executor.layers.quantization.gguf import GGUFLinearMethod

    model, tokenizer = smollm2_hf
    # EOS off on both sides (ignore_eos here), so an early end-of-turn cannot shorten either.
    model.generation_config.eos_token_id = None
    outputs = smollm2_llm.generate(GGUF_PROMPTS, greedy(GGUF_TOKENS), use_tqdm=False)
    assert_no_leaks(smollm2_llm)
    octavo_model = smollm2_llm.llm_engine.engine_core.executor.worker.model_runner.model
    # Kept in GGUF blocks on a backend's kernels (the CPU's round activations to int8).
    kept_quantized = any(isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
                         and m.quant_method.config.kernels is not None
                         for m in octavo_model.modules())
    for prompt, output in zip(GGUF_PROMPTS, outputs):
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert output.prompt_token_ids == input_ids[0].tolist()
        mine = token_ids([output])[0]
        if not kept_quantized:  # the same float32 weights: the same tokens
            with torch.inference_mode():
                expected = model.generate(
                    input_ids, do_sample=False, max_new_tokens=GGUF_TOKENS,
                    pad_token_id=tokenizer.eos_token_id,
                )[0, input_ids.shape[1]:].tolist()
            assert mine == expected, prompt
            continue
        # HF's log-probabilities along Octavo's own sequence (teacher forcing).
        sequence = torch.tensor([input_ids[0].tolist() + mine])
        with torch.inference_mode():
            logits = model(sequence).logits[0, input_ids.shape[1] - 1:-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for i, token in enumerate(mine):
            gap = float(logprobs[i].max() - logprobs[i, token])
            assert gap <= GGUF_NEAR_TIE, (prompt, i, token, gap)


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2_llm) -> None:
    out = smollm2_llm.generate("The capital of France is",
                               SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris"), out[0].outputs[0].text
    assert_no_leaks(smollm2_llm)


def test_sliding_window_model_runs_at_full_context(tiny_model_factory) -> None:
    """Mistral with a window of 8: the context is the model's 512 positions, not the window
    (the HF match above runs its prompts past the window)."""
    llm = make_llm(tiny_model_factory("mistral-swa"))
    try:
        model_config = llm.llm_engine.config.model_config
        assert model_config.max_model_len == 512
        assert model_config.sliding_windows == (8, 8)
    finally:
        llm.llm_engine.shutdown()
