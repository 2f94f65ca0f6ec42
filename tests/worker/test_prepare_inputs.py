"""The model runner's step inputs (``ModelRunner._prepare_inputs``: input ids, positions and
slots built with numpy from per-request ranges) are exactly what the per-token loop it replaced
built, step by step, for every kind of step: prompt chunks (chunked prefill), prefix-cache hits,
preemption (recompute), mixed steps, pure decodes, tokens in flight (async scheduling), forks
(n > 1), prompt logprobs and speculative drafts. The per-token loop is kept here as
``_reference_inputs``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, prompts_of_lengths
from tests.worker.test_decode_rows import PROMPTS, SETTINGS


def _reference_inputs(runner, so) -> dict:
    """A step's host inputs, built token by token as ``_prepare_inputs`` did before it was
    vectorised (``flat_host`` is what goes to ``_flat_to_device``)."""
    bs = runner.block_size
    req_ids = [r.req_id for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
    ids, positions, slots, pending_flat, pending_rows = [], [], [], [], []
    query_start_loc, seq_lens, widths = [0], [], []
    sample_indices, sample_rows, before, samples = [], [], [], []
    prompt_positions, sample_of = {}, {}
    spec = so.scheduled_spec_decode_tokens
    spec_drafts = [] if spec or runner.drafter is not None else None
    for req_id in req_ids:
        state = runner.requests[req_id]
        start = state.num_computed_tokens
        num_new = so.num_scheduled_tokens[req_id]
        end = start + num_new
        num_known = len(state.token_ids)
        drafts = spec.get(req_id, []) if spec else []
        if drafts:
            ids += [state.token_ids[start], *drafts]
            num_known = end
        elif num_new == 1 and start >= num_known:  # in flight
            pending_flat.append(len(ids))
            pending_rows.append(state.block_table_row)
            ids.append(0)
            num_known += 1
        else:
            ids += state.token_ids[start:end]
        positions += range(start, end)
        slots += [state.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        flat_start = query_start_loc[-1]
        query_start_loc.append(flat_start + num_new)
        seq_lens.append(end)
        widths.append(len(state.block_ids))
        samples.append(end == num_known)
        if end == num_known:
            sample_indices += range(flat_start + num_new - 1 - len(drafts), flat_start + num_new)
            before.append(end - len(drafts))
            sample_rows.append(state.block_table_row)
            if spec_drafts is not None:
                spec_drafts.append(drafts)
            sample_of[req_id] = (flat_start + num_new - 1, end)
        if state.sampling_params.prompt_logprobs is not None:
            last = min(end, state.num_prompt_tokens - 1)
            if start < last:
                prompt_positions[req_id] = ([flat_start + p - start for p in range(start, last)],
                                            state.token_ids[start + 1 : last + 1])
    for fork in so.forked_reqs:
        flat_index, end = sample_of[fork.parent_req_id]
        req_ids.append(fork.req_id)
        samples.append(True)
        sample_indices.append(flat_index)
        before.append(end)
        sample_rows.append(runner.requests[fork.req_id].block_table_row)
        if spec_drafts is not None:
            spec_drafts.append([])
    sampled_rows = runner.decode_rows.sampled_row[np.array(pending_rows, dtype=np.intp)]
    rows = [runner.requests[r].block_table_row for r in req_ids[: len(seq_lens)]]
    return {
        "flat_host": ids + positions + slots + pending_flat + sampled_rows.tolist()
        + sample_indices,
        "num_tokens": len(ids),
        "num_pending": len(pending_flat),
        "block_tables": runner.block_table.gather(rows, max(widths)).tolist(),
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "num_tokens_before_sample": before,
        "req_ids": req_ids,
        "samples": samples,
        "sample_rows": sample_rows,
        "prompt_logprob_positions": prompt_positions,
        "spec_drafts": spec_drafts,
    }


def _compare_every_step(llm) -> list[tuple[int, int, bool]]:
    """Wrap the runner so that every step's inputs are compared with ``_reference_inputs``;
    returns (number of requests, number of tokens, whether the inputs were read as a view of
    the last step's sampled tokens) per step compared."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    prepare, flat_to_device = runner._prepare_inputs, runner._flat_to_device
    checked: list[tuple[int, int]] = []
    sent: list[tuple] = []

    def recording_flat_to_device(flat_host, num_tokens, num_pending):
        sent.append((flat_host.tolist(), num_tokens, num_pending))
        return flat_to_device(flat_host, num_tokens, num_pending)

    def compared(so):
        want = _reference_inputs(runner, so)
        sent.clear()
        inputs = prepare(so)
        md = inputs.metadata
        got = {
            "flat_host": sent[0][0],
            "num_tokens": sent[0][1],
            "num_pending": sent[0][2],
            "block_tables": md.block_tables.tolist(),
            "query_start_loc": md.query_start_loc_cpu,
            "seq_lens": md.seq_lens_cpu,
            "num_tokens_before_sample": inputs.num_tokens_before_sample,
            "req_ids": inputs.req_ids,
            "samples": inputs.samples,
            "sample_rows": inputs.sample_rows.tolist(),
            "prompt_logprob_positions": inputs.prompt_logprob_positions,
            "spec_drafts": inputs.spec_drafts,
        }
        assert got == want
        num_tokens = want["num_tokens"]
        # The device tensors are the host vectors' slices.
        assert inputs.positions.tolist() == want["flat_host"][num_tokens : 2 * num_tokens]
        assert md.slot_mapping.tolist() == want["flat_host"][2 * num_tokens : 3 * num_tokens]
        assert md.query_start_loc.tolist() == want["query_start_loc"]
        assert md.seq_lens.tolist() == want["seq_lens"]
        assert md.max_query_len == max(np.diff(want["query_start_loc"]))
        # The shortcuts of a steady decode: every input pending, input i being row i of the
        # last step's sampled tokens; and sampled rows that are the first rows.
        num_pending = want["num_pending"]
        pending_rows = want["flat_host"][3 * num_tokens + num_pending : 3 * num_tokens
                                         + 2 * num_pending]
        assert inputs.pending_in_order == (num_pending == num_tokens
                                           and pending_rows == list(range(num_tokens)))
        if inputs.samples_first_rows:
            sample_indices = want["flat_host"][3 * num_tokens + 2 * num_pending:]
            assert sample_indices == list(range(len(want["sample_rows"])))
        checked.append((len(want["seq_lens"]), num_tokens, inputs.pending_in_order))
        return inputs

    runner._prepare_inputs = compared
    runner._flat_to_device = recording_flat_to_device
    return checked


def _generate(llm, prompts, params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.outputs[i].token_ids, o.outputs[i].finish_reason)
            for o in outputs for i in range(len(o.outputs))]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_inputs_are_the_per_token_loops(tiny_llama: Path, setting: str,
                                        async_scheduling: bool) -> None:
    """Chunked prefill with prefix-cache hits, mixed steps, pure decodes and (in the small
    pool) preemption by recompute, with and without tokens in flight."""
    llm = make_llm(tiny_llama, enable_prefix_caching=True, async_scheduling=async_scheduling,
                   **SETTINGS[setting])
    checked = _compare_every_step(llm)
    _generate(llm, PROMPTS, [greedy(6 + 5 * (i % 4)) for i in range(len(PROMPTS))])
    stats = llm.llm_engine.stats()
    assert stats.prefix_cache_hits > 0
    if setting == "preempting":
        assert stats.num_preemptions > 0
    # Steps of several requests holding prompt chunks (more tokens than requests), and pure
    # decodes (as many tokens as requests).
    assert any(1 < num_reqs < num_tokens for num_reqs, num_tokens, _ in checked), checked
    assert any(num_reqs == num_tokens > 1 for num_reqs, num_tokens, _ in checked), checked
    # With tokens in flight, steady decodes read them as a view of the last sampled tokens.
    assert any(in_order for _, _, in_order in checked) == async_scheduling, checked
    llm.llm_engine.shutdown()


def test_forks_and_prompt_logprobs(tiny_llama: Path) -> None:
    params = [SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=8, ignore_eos=True)
              if i % 3 == 0 else greedy(4 + i, prompt_logprobs=1) if i in (4, 7) else greedy(10)
              for i in range(len(PROMPTS))]
    for async_scheduling in (False, True):
        llm = make_llm(tiny_llama, enable_prefix_caching=True,
                       async_scheduling=async_scheduling, **SETTINGS["roomy"])
        checked = _compare_every_step(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                               use_tqdm=False)
        assert outputs[4].prompt_logprobs and outputs[7].prompt_logprobs
        assert len(outputs[0].outputs) == 2
        assert checked
        llm.llm_engine.shutdown()


def test_speculative_steps(tiny_llama: Path) -> None:
    """ngram drafts verified beside prompt chunks (a 16-token budget)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23, 24] * 3,
               *prompts_of_lengths([9, 23], seed=8)]
    llm = make_llm(tiny_llama, enable_prefix_caching=True, max_num_batched_tokens=16,
                   block_size=4, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 1,
                                                     "prompt_lookup_max": 3})
    checked = _compare_every_step(llm)
    _generate(llm, prompts, greedy(16))
    assert llm.llm_engine.engine_core.scheduler.spec_stats.num_draft_tokens > 0
    assert checked
    llm.llm_engine.shutdown()
