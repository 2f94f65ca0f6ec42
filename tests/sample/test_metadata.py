"""``SamplingMetadata.from_rows``: fast-path flags, padding, dropped ids and step seeds."""

from __future__ import annotations

import pytest
import torch
from octavo.sample import SamplingMetadata, step_seed

from tests.sample.helpers import make_row

VOCAB = 10


def test_all_greedy_skips_every_sampling_tensor() -> None:
    rows = [make_row(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=1)] * 2
    metadata = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    assert metadata.all_greedy and not metadata.all_random
    assert metadata.temperature is None
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties
    assert metadata.seeded_rows == []  # greedy rows draw nothing
    assert metadata.max_num_logprobs is None


def test_mixed_rows_fill_neutral_values() -> None:
    rows = [make_row(temperature=0.0), make_row(temperature=0.5, top_k=20, top_p=0.9), make_row()]
    metadata = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.greedy_mask.tolist() == [True, False, False]
    assert metadata.temperature is not None and metadata.temperature.tolist() == [1.0, 0.5, 1.0]
    assert metadata.top_k is not None and metadata.top_k.tolist() == [VOCAB, VOCAB, VOCAB]
    assert metadata.top_p is not None
    assert torch.allclose(metadata.top_p, torch.tensor([1.0, 0.9, 1.0]))
    assert metadata.min_p is None


def test_penalty_tensors_are_padded_with_vocab_size() -> None:
    rows = [
        make_row(prompt=[1, 2, 3], output=[4], frequency_penalty=0.5),
        make_row(prompt=[5], output=[6, 7, 12]),
    ]
    metadata = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    assert metadata.prompt_token_ids is None  # only the repetition penalty reads the prompt
    assert metadata.repetition_penalties is None and metadata.presence_penalties is None
    assert metadata.output_token_ids is not None
    assert metadata.output_token_ids.tolist() == [[4, VOCAB, VOCAB], [6, 7, VOCAB]]
    rows[1].params.repetition_penalty = 1.2
    metadata = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    assert metadata.prompt_token_ids is not None
    assert metadata.prompt_token_ids.tolist() == [[1, 2, 3], [5, VOCAB, VOCAB]]


def test_bias_and_min_tokens_pairs_drop_out_of_vocab_ids() -> None:
    row = make_row(logit_bias={1: 2.0, VOCAB: 3.0}, min_tokens=2, stop_token_ids=[4, 40])
    row.params.all_stop_token_ids = {0, 99}
    done = make_row(output=[1, 1], min_tokens=2, stop_token_ids=[4])
    metadata = SamplingMetadata.from_rows([done, row], VOCAB, "cpu")
    assert metadata.bias_row_ids is not None and metadata.bias_row_ids.tolist() == [1]
    assert metadata.bias_token_ids is not None and metadata.bias_token_ids.tolist() == [1]
    assert metadata.min_tokens_row_ids is not None
    assert metadata.min_tokens_row_ids.tolist() == [1, 1]
    assert metadata.min_tokens_token_ids is not None
    assert metadata.min_tokens_token_ids.tolist() == [0, 4]


def test_seeded_rows_and_max_logprobs() -> None:
    rows = [make_row(seed=5, output=[1, 2]), make_row(logprobs=3), make_row(seed=6, logprobs=1)]
    metadata = SamplingMetadata.from_rows(rows, VOCAB, "cpu")
    assert metadata.seeded_rows == [(0, step_seed(5, 2)), (2, step_seed(6, 0))]
    assert metadata.max_num_logprobs == 3


def test_step_seed() -> None:
    assert step_seed(1, 0) == step_seed(1, 0)
    values = {step_seed(s, p) for s in range(-5, 5) for p in range(10)}
    assert len(values) == 100
    assert all(0 <= v < 2**64 for v in values)
    torch.Generator().manual_seed(step_seed(-(2**63), 10**9))  # accepted by torch
    with pytest.raises(ValueError, match="position"):
        step_seed(1, -1)


def test_bad_vocab_size() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingMetadata.from_rows([make_row()], 0, "cpu")
