"""The LM head's row ladder (``octavo.worker.logits_rows``): the padded counts, logits equal to
the unpadded head's, the warm-up, and a model runner using it giving the same greedy (also
JSON-constrained) and sampled outputs as one without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.worker.cuda_graph import capture_sizes
from octavo.worker.logits_rows import ROW_ALIGNMENT, LogitsRowLadder

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, prompts_of_lengths


def test_padded_is_the_smallest_ladder_size_then_a_multiple_of_the_alignment():
    ladder = LogitsRowLadder(capture_sizes(48))  # 1, 2, 4, 8, 16, 32, 48
    assert ladder.sizes == [1, 2, 4, 8, 16, 32, 48]
    assert [ladder.padded(n) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 33, 48)] == [
        0, 1, 2, 4, 8, 8, 16, 16, 32, 48, 48]
    assert ladder.padded(49) == ROW_ALIGNMENT
    assert ladder.padded(130) == 3 * ROW_ALIGNMENT
    assert LogitsRowLadder([5, 3, 3]).sizes == [3, 5]
    with pytest.raises(ValueError, match="positive sizes"):
        LogitsRowLadder([])


def test_logits_are_the_unpadded_heads_and_the_head_sees_ladder_sizes():
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    seen: list[int] = []

    def head(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return (hidden @ weight.T).float()

    ladder = LogitsRowLadder([1, 2, 4, 8])
    for rows in (1, 3, 5, 8, 11):
        hidden = torch.randn(rows, 8)
        got = ladder.logits(head, hidden)
        assert got.shape == (rows, 50) and got.is_contiguous()
        torch.testing.assert_close(got, hidden @ weight.T, rtol=1e-6, atol=1e-6)
    assert seen == [1, 4, 8, 8, ROW_ALIGNMENT]


def test_warm_up_runs_the_head_once_at_each_size():
    seen: list[tuple[int, int]] = []
    ladder = LogitsRowLadder([1, 2, 4])
    ladder.warm_up(lambda h: seen.append(tuple(h.shape)) or h, 6, torch.float32,
                   torch.device("cpu"))
    assert seen == [(1, 6), (2, 6), (4, 6)]


PROMPTS = prompts_of_lengths([5, 12, 17, 3, 9, 21, 2], seed=8)


def _generate(model: Path, params, ladder: list[int] | None, async_scheduling: bool):
    llm = make_llm(model, async_scheduling=async_scheduling, max_num_batched_tokens=16,
                   block_size=4)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    rows: list[int] = []
    if ladder is not None:
        runner.use_logits_row_ladder(ladder)
        compute_logits = runner.model.compute_logits
        runner.model.compute_logits = lambda h: rows.append(h.shape[0]) or compute_logits(h)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert_no_leaks(llm)
    llm.llm_engine.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], rows


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_runner_with_a_ladder_gives_the_same_outputs(tiny_llama: Path, async_scheduling: bool):
    params = [greedy(4 + 3 * i) for i in range(len(PROMPTS))]
    want, _ = _generate(tiny_llama, params, None, async_scheduling)
    got, rows = _generate(tiny_llama, params, [1, 2, 4, 8], async_scheduling)
    assert got == want
    # Steps sampled 1-7 rows; the head only ever saw ladder sizes.
    assert rows and set(rows) <= {1, 2, 4, 8} and 4 in rows and 8 in rows


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
            params.append(greedy(7))
    want, _ = _generate(tiny_llama, params, None, True)
    got, rows = _generate(tiny_llama, params, [1, 2, 4, 8], True)
    assert got == want
    assert set(rows) <= {1, 2, 4, 8}
