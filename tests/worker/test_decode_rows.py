"""The model runner's vectorised pure-decode inputs (``octavo.worker.decode_rows``) are exactly
the inputs its general loop builds, step by step, under preemption, prefix caching, chunked
prefill, mixed steps, finishing requests, forks and async scheduling (tokens in flight); and
the outputs with the vectorised path on and off are the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from octavo.sampling_params import SamplingParams
from octavo.worker.decode_rows import DecodeRows

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, prompts_of_lengths

# 12 requests: shared prefixes (prefix cache hits), prompts longer than the 16-token budget
# (chunked prefill beside decodes), different lengths (requests finish in different steps).
PREFIX = prompts_of_lengths([16], seed=4)[0]
PROMPTS = ([PREFIX + p for p in prompts_of_lengths([3, 9, 21], seed=5)]
           + prompts_of_lengths([5, 12, 17, 33, 2, 7, 26, 11], seed=6) + [PREFIX + [7]])

SETTINGS = {
    # 24 blocks of 4 tokens for 12 requests: preemption (recompute) while tokens are in flight.
    "preempting": {"block_size": 4, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 16},
    "roomy": {"block_size": 4, "max_num_batched_tokens": 16},
}


def _as_lists(inputs) -> dict:
    md = inputs.metadata
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": md.slot_mapping.tolist(),
        "query_start_loc": md.query_start_loc.tolist(),
        "seq_lens": md.seq_lens.tolist(),
        "block_tables": md.block_tables.tolist(),
        "scalars": (md.num_seqs, md.num_tokens, md.max_query_len, md.max_seq_len),
        "cpu": (md.query_start_loc_cpu, md.seq_lens_cpu),
        "sample_indices": inputs.sample_indices.tolist(),
        "num_tokens_before_sample": inputs.num_tokens_before_sample,
        "req_ids": inputs.req_ids,
        "samples": inputs.samples,
        "sample_rows": inputs.sample_rows.tolist(),
        "prompt_logprob_positions": inputs.prompt_logprob_positions,
        "spec_drafts": inputs.spec_drafts,
    }


def _run(model: Path, settings: dict, params, async_scheduling: bool, vectorised: bool,
         checked: list[int]):
    """Generate; with ``vectorised``, every pure-decode step's inputs are also built by the
    general loop and compared (``checked`` counts the steps compared)."""
    llm = make_llm(model, enable_prefix_caching=True, async_scheduling=async_scheduling,
                   **settings)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    runner.vectorised_decode = vectorised
    vectorised_inputs = runner._prepare_decode_inputs

    def compared(so):
        inputs = vectorised_inputs(so)
        if inputs is not None:
            runner.vectorised_decode = False
            try:
                general = runner._prepare_inputs(so)
            finally:
                runner.vectorised_decode = True
            assert _as_lists(inputs) == _as_lists(general)
            checked.append(len(inputs.req_ids))
        return inputs

    runner._prepare_decode_inputs = compared
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    preemptions = llm.llm_engine.stats().num_preemptions
    assert_no_leaks(llm)
    llm.llm_engine.shutdown()
    return [(o.outputs[i].token_ids, o.outputs[i].finish_reason)
            for o in outputs for i in range(len(o.outputs))], preemptions


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_vectorised_decode_inputs_are_the_general_loops(tiny_llama: Path, setting: str,
                                                       async_scheduling: bool) -> None:
    params = [greedy(6 + 5 * (i % 4)) for i in range(len(PROMPTS))]
    checked: list[int] = []
    got, preemptions = _run(tiny_llama, SETTINGS[setting], params, async_scheduling, True,
                            checked)
    # Pure-decode steps were built, of several requests (fewer when the pool is small).
    assert len(checked) >= 10 and max(checked) >= (4 if setting == "preempting" else 8), checked
    if setting == "preempting":
        assert preemptions > 0
    off: list[int] = []
    want, _ = _run(tiny_llama, SETTINGS[setting], params, async_scheduling, False, off)
    assert not off
    assert got == want


def test_steps_with_forks_and_prompt_logprobs_take_the_general_loop(tiny_llama: Path) -> None:
    """n > 1 (forks) and prompt logprobs keep steps general while such a request lives; the
    pure-decode steps around them still match the general loop."""
    params = [SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=8, ignore_eos=True)
              if i % 3 == 0 else greedy(4 + i, prompt_logprobs=1) if i == 4 else greedy(10)
              for i in range(len(PROMPTS))]
    for async_scheduling in (False, True):
        checked: list[int] = []
        got, _ = _run(tiny_llama, SETTINGS["roomy"], params, async_scheduling, True, checked)
        assert checked
        want, _ = _run(tiny_llama, SETTINGS["roomy"], params, async_scheduling, False, [])
        assert got == want


def test_decode_rows_drop_tokens_of_a_row_with_a_new_owner() -> None:
    rows = DecodeRows(2)
    rows.claim(0, [5, 6, 7])
    rows.claim(1, [9])
    epochs, num_claims = rows.epoch[np.array([0, 1])], rows.num_claims
    rows.append_sampled(np.array([0, 1]), epochs, num_claims, np.array([8, 3]))
    assert rows.num_tokens[:2].tolist() == [4, 2] and rows.last_token[:2].tolist() == [8, 3]
    epochs, num_claims = rows.epoch[np.array([0, 1])], rows.num_claims
    rows.claim(1, [1, 2])  # the request on row 1 was forgotten, a new one took the row
    rows.append_sampled(np.array([0, 1]), epochs, num_claims, np.array([4, 3]))
    assert rows.num_tokens[:2].tolist() == [5, 2]
    assert rows.last_token[:2].tolist() == [4, 2]
    rows.claim(5, [4])  # grows
    assert rows.num_tokens[5] == 1 and rows.sampled_row[5] == -1 and len(rows.epoch) >= 6


def test_vectorised_decode_is_taken_in_steady_decode(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    taken = []
    vectorised_inputs = runner._prepare_decode_inputs
    runner._prepare_decode_inputs = lambda so: taken.append(vectorised_inputs(so)) or taken[-1]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], greedy(8))
    # Every step after the prefill is a pure decode, and built by the vectorised path.
    assert len(taken) == 7 and all(t is not None for t in taken)
    assert all(isinstance(t.input_ids, torch.Tensor) for t in taken)
    llm.llm_engine.shutdown()


def test_a_one_token_prompt_chunk_falls_back_to_the_general_loop(tiny_llama: Path) -> None:
    """With a 2-token budget a prompt runs one token a step beside a decode: every request runs
    one token, but the prompt's input is not its last token (``_prepare_decode_inputs`` returns
    None, the general loop builds the step); the outputs are those of the general loop."""
    settings = {"block_size": 4, "max_num_batched_tokens": 2, "max_model_len": 64,
                "enable_chunked_prefill": True}
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
    results = {}
    for vectorised in (True, False):
        llm = make_llm(tiny_llama, async_scheduling=False, **settings)
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        runner.vectorised_decode = vectorised
        built = []
        vectorised_inputs = runner._prepare_decode_inputs
        runner._prepare_decode_inputs = lambda so: built.append(vectorised_inputs(so)) or built[-1]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6))
        results[vectorised] = [o.outputs[0].token_ids for o in outputs]
        if vectorised:
            assert any(b is None for b in built) and any(b is not None for b in built)
        llm.llm_engine.shutdown()
    assert results[True] == results[False]
