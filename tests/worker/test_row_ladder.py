"""GEMM row counts on a ladder (``octavo.worker.row_ladder``): the padded counts, LM-head logits
equal to the unpadded head's, the warm-up, inert padding tokens for eager steps, and a model
runner using the ladder giving the same greedy (also constrained) and sampled outputs as one
without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.worker.cuda_graph import capture_sizes
from octavo.attention.base import AttentionMetadata
from octavo.worker.row_ladder import RowLadder, pad_step, padded_logits, warm_up_logits

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, prompts_of_lengths


def test_padded_is_the_smallest_ladder_size_then_within_a_sixteenth():
    ladder = RowLadder(capture_sizes(48))  # 1, 2, 4, 8, 16, 32, 48
    assert ladder.sizes == [1, 2, 4, 8, 16, 32, 48]
    assert [ladder.padded(n) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 33, 48)] == [
        0, 1, 2, 4, 8, 8, 16, 16, 32, 48, 48]
    # Past the top: a multiple of 1/16 of the count's power of two.
    assert [ladder.padded(n) for n in (49, 130, 300, 4097, 8191, 8192)] == [
        50, 136, 304, 4352, 8192, 8192]
    for rows in range(49, 9000):
        padded = ladder.padded(rows)
        assert rows <= padded < rows + rows / 16 + 1
    # Few distinct counts up to an 8,192-token budget (each a kernel choice once): ~120 past
    # a top of 48, ~100 past the default 256.
    assert len({ladder.padded(n) for n in range(1, 8193)}) <= 128
    assert len({RowLadder(capture_sizes(256)).padded(n) for n in range(1, 8193)}) <= 100
    assert RowLadder([5, 3, 3]).sizes == [3, 5]
    with pytest.raises(ValueError, match="positive sizes"):
        RowLadder([])


def test_logits_are_the_unpadded_heads_and_the_head_sees_ladder_sizes():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    seen: list[int] = []

    def head(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return (hidden @ weight.T).float()

    ladder = RowLadder([1, 2, 4, 8])
    for rows in (1, 3, 5, 8, 11):
        hidden = torch.randn(rows, 8)
        got = padded_logits(ladder, head, hidden)
        assert got.shape == (rows, 50) and got.is_contiguous()
        torch.testing.assert_close(got, hidden @ weight.T, rtol=1e-6, atol=1e-6)
    assert seen == [1, 4, 8, 8, 11]


def test_warm_up_runs_the_head_once_at_each_size():
    seen: list[tuple[int, int]] = []
    warm_up_logits(RowLadder([1, 2, 4]), lambda h: seen.append(tuple(h.shape)) or h, 6,
                   torch.float32, torch.device("cpu"))
    assert seen == [(1, 6), (2, 6), (4, 6)]


def test_pad_step_appends_inert_tokens():
    metadata = AttentionMetadata.from_lists(
        slot_mapping=[4, 5, 6, 9, 10], query_start_loc=[0, 3, 5], seq_lens=[3, 7],
        block_tables=[[1, 0], [2, 3]])
    ids, positions = torch.tensor([7, 8, 9, 3, 2]), torch.tensor([0, 1, 2, 5, 6])
    ladder = RowLadder([1, 2, 4, 8])
    padded_ids, padded_positions, padded = pad_step(ladder, ids, positions, metadata)
    assert padded_ids.tolist() == [7, 8, 9, 3, 2, 0, 0, 0]
    assert padded_positions.tolist() == [0, 1, 2, 5, 6, 0, 0, 0]
    assert padded.slot_mapping.tolist() == [4, 5, 6, 9, 10, -1, -1, -1]
    assert padded.num_tokens == 8 and padded.num_seqs == 2
    assert padded.query_start_loc.tolist() == [0, 3, 5] and padded.seq_lens.tolist() == [3, 7]
    assert metadata.num_tokens == 5  # the step's own metadata is left as it was
    same = pad_step(ladder, ids[:4], positions[:4], AttentionMetadata.from_lists(
        slot_mapping=[4, 5, 6, 9], query_start_loc=[0, 3, 4], seq_lens=[3, 6],
        block_tables=[[1, 0], [2, 3]]))
    assert same[0].shape[0] == 4 and same[2].num_tokens == 4


PROMPTS = prompts_of_lengths([5, 12, 17, 3, 9, 21, 2], seed=8)


def _generate(model: Path, params, ladder: list[int] | None, async_scheduling: bool,
              pad_eager_steps: bool = False):
    llm = make_llm(model, async_scheduling=async_scheduling, max_num_batched_tokens=16,
                   block_size=4)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    rows: list[int] = []
    tokens: list[int] = []
    if ladder is not None:
        runner.use_row_ladder(ladder, pad_eager_steps=pad_eager_steps)
        compute_logits, forward = runner.model.compute_logits, runner._forward
        runner.model.compute_logits = lambda h: rows.append(h.shape[0]) or compute_logits(h)
        runner._forward = lambda ids, *a: tokens.append(ids.shape[0]) or forward(ids, *a)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert_no_leaks(llm)
    llm.llm_engine.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], rows, tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("pad_eager_steps", [False, True])
def test_runner_with_a_ladder_gives_the_same_outputs(tiny_llama: Path, async_scheduling: bool,
                                                     pad_eager_steps: bool):
    params = [greedy(4 + 3 * i) for i in range(len(PROMPTS))]
    want, _, _ = _generate(tiny_llama, params, None, async_scheduling)
    got, rows, tokens = _generate(tiny_llama, params, [1, 2, 4, 8], async_scheduling,
                                  pad_eager_steps)
    assert got == want
    # Steps sampled 1-7 rows; the head only ever saw ladder sizes.
    assert rows and set(rows) <= {1, 2, 4, 8} and 4 in rows and 8 in rows
    # Steps of 1-16 tokens (a 16-token budget): padded to 1, 2, 4, 8 or 16 when asked.
    assert tokens
    if pad_eager_steps:
        assert set(tokens) <= {1, 2, 4, 8, 16}
    else:
        assert not set(tokens) <= {1, 2, 4, 8, 16}


def test_runner_with_a_ladder_keeps_constrained_and_sampled_outputs(tiny_llama: Path):
    """The grammar's masks go on the cut-off rows (the in-place greedy path and the sampler's
    path), and seeded sampling draws the same tokens."""
    params = []
    for i in range(len(PROMPTS)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=
                                         StructuredOutputsParams(regex="[ab]{3,8}")))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=9,
                                         ignore_eos=True))
        else:
            params.append(greedy(7, prompt_logprobs=2) if i == 2 else greedy(7))
    want, _, _ = _generate(tiny_llama, params, None, True)
    got, rows, _ = _generate(tiny_llama, params, [1, 2, 4, 8], True, pad_eager_steps=True)
    assert got == want
    # Sampled rows on the ladder; the prompt's logprob rows (12, past its top) on its
    # geometric part.
    assert all(RowLadder([1, 2, 4, 8]).padded(r) == r for r in rows) and 12 in rows
