"""Helpers for end-to-end tests through ``octavo.LLM``: building engines, leak checks, prompts.

The leak check and the prompt helpers ship with the core (``octavo.testing.engine_checks``, used
by the backend conformance suite too) and are re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from octavo.testing.engine_checks import (  # noqa: F401  (re-exported)
    assert_no_leaks,
    greedy,
    prompts_of_lengths,
    random_prompts,
    token_ids,
)

# Every tiny architecture the engine supports (llama3-rope: Llama with llama3 rope scaling;
# mistral-swa: Mistral with a sliding window shorter than the tests' sequences).
TINY_ARCHS = ("llama", "llama3-rope", "mistral", "mistral-swa", "qwen2", "qwen3", "mixtral",
              "qwen2_moe", "qwen3_moe", "gemma2", "gemma3", "phi3")

# Enough blocks for every workload of the tests unless a test wants a small pool.
DEFAULT_NUM_BLOCKS = 512


def make_llm(model: str | Path, **kwargs: Any):
    """An ``octavo.LLM`` in float32 with a small, fixed KV cache (never sized from host memory)."""
    import octavo

    kwargs.setdefault("dtype", "float32")
    if "kv_cache_memory_bytes" not in kwargs:
        kwargs.setdefault("num_gpu_blocks_override", DEFAULT_NUM_BLOCKS)
    return octavo.LLM(str(model), **kwargs)


def record_mixed_spec_steps(llm) -> list:
    """Wrap ``llm``'s scheduler so that every step mixing a prefill chunk (a request adding
    several tokens without drafts) with draft verification is recorded; return that list."""
    scheduler = llm.llm_engine.engine_core.scheduler
    schedule = scheduler.schedule
    mixed_steps: list = []

    def recording_schedule():
        out = schedule()
        drafts = out.scheduled_spec_decode_tokens
        if drafts and any(r not in drafts and n > 1 for r, n in out.num_scheduled_tokens.items()):
            mixed_steps.append(out)
        return out

    scheduler.schedule = recording_schedule
    return mixed_steps


def spec_prompts() -> list[list[int]]:
    """Prompts for speculative-decoding tests: repetitive ones (ngram proposals from the
    prompt) and random ones (tiny random models soon repeat themselves)."""
    return ([[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23, 24] * 3, [100, 101, 102]]
            + random_prompts(5, 4, 30, seed=7))


class EagerHeadGraphRunner:
    """Stands in for an EAGLE head's CUDA graphs on the CPU: runs the module the worker would
    capture (``EagleProposer.graph_model``: the head reading its hidden-state input from a
    persistent buffer) for steps of at most ``max_query_len`` tokens a sequence, and records
    each step's query length."""

    def __init__(self, drafter, max_tokens: int, max_query_len: int) -> None:
        self.module = drafter.graph_model(max_tokens)
        self.drafter = drafter
        self.max_query_len = max_query_len
        self.query_lens: list[int] = []

    def can_run(self, metadata) -> bool:
        return metadata.max_query_len <= self.max_query_len

    def run(self, input_ids, positions, metadata):
        self.query_lens.append(metadata.max_query_len)
        return self.module(input_ids, positions, self.drafter.kv_caches, metadata)


def record_proposals(llm) -> list[tuple[str, list[int]]]:
    """The (request id, draft tokens) of every proposal ``llm``'s in-process engine core
    records from now on, in order (a list that fills as it runs)."""
    core = llm.llm_engine.engine_core
    update = core.scheduler.update_from_output
    seen: list[tuple[str, list[int]]] = []

    def recording_update(scheduler_output, runner_output):
        for req_id in runner_output.req_ids:
            if req_id in runner_output.spec_token_ids:
                seen.append((req_id, list(runner_output.spec_token_ids[req_id])))
        return update(scheduler_output, runner_output)

    core.scheduler.update_from_output = recording_update
    return seen


def assert_speculation_survives_caching_and_preemption(folder, speculative_config: dict,
                                                       run, reference) -> None:
    """``run(llm)`` (greedy token ids) equals ``reference`` with ``speculative_config``: with
    prefix caching, run twice (the second run hits the cache), and under preemption by
    recompute and by swap (a 16-block pool)."""
    warm = make_llm(folder, speculative_config=speculative_config, enable_prefix_caching=True,
                    max_num_batched_tokens=16)
    assert run(warm) == reference
    hits = warm.llm_engine.stats().prefix_cache_hits
    assert run(warm) == reference
    assert warm.llm_engine.stats().prefix_cache_hits > hits
    for mode in ("recompute", "swap"):
        llm = make_llm(folder, speculative_config=speculative_config,
                       num_gpu_blocks_override=16, preemption_mode=mode, swap_space=0.01)
        assert run(llm) == reference
        assert llm.llm_engine.stats().num_preemptions > 0


def grammar_tokenizer(tokenizer: Any):
    """``tokenizer`` (a ``transformers`` fast tokenizer) as grammars use it, its EOS id the
    only one."""
    from octavo.structured_output.tokenizer import GrammarTokenizer

    return GrammarTokenizer.from_transformers(tokenizer, {tokenizer.eos_token_id})


def grammar_process(model: str | Path, vocab_size: int, **kwargs: Any):
    """A ``GrammarProcess`` whose tokenizer is ``model``'s, loaded as the engine core does."""
    import functools

    from octavo.engine.arg_utils import EngineArgs
    from octavo.structured_output.process import GrammarProcess
    from octavo.structured_output.tokenizer import load_grammar_tokenizer

    model_config = EngineArgs(model=str(model), device="cpu").create_engine_config().model_config
    return GrammarProcess(functools.partial(load_grammar_tokenizer, model_config), vocab_size,
                          **kwargs)


def assert_close_logprobs(got, want, *, abs_tol: float = 2e-4, same_ranks: bool = False) -> None:
    """Logprob dictionaries (per completion, per position; a completion or position may be
    None) equal in token ids and within ``abs_tol`` in value; with ``same_ranks`` also equal
    in rank and decoded text."""
    import pytest

    for completion, want_completion in zip(got, want, strict=True):
        if want_completion is None:
            assert completion is None
            continue
        for position, want_position in zip(completion, want_completion, strict=True):
            if want_position is None:
                assert position is None
                continue
            assert position.keys() == want_position.keys()
            for token, entry in position.items():
                expected = want_position[token]
                assert entry.logprob == pytest.approx(expected.logprob, abs=abs_tol)
                if same_ranks:
                    assert entry.rank == expected.rank
                    assert entry.decoded_token == expected.decoded_token
