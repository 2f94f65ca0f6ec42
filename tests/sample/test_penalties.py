"""Exact values of the repetition, frequency and presence penalties."""

from __future__ import annotations

import pytest
import torch

from octavo.sample import Sampler, SamplingMetadata, SamplingRow
from tests.sample.helpers import make_row

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
PROMPT = [0, 1]
OUTPUT = [3, 3, 4]


def processed(rows: list[SamplingRow], logits: list[list[float]] | None = None) -> torch.Tensor:
    """Logits after bias, min_tokens and penalties: what greedy rows take the argmax of."""
    values = torch.tensor(logits or [LOGITS] * len(rows))
    metadata = SamplingMetadata.from_rows(rows, values.shape[1], values.device)
    return Sampler().process_logits(values, metadata)


def penalized(**params: object) -> torch.Tensor:
    return processed([make_row(prompt=PROMPT, output=OUTPUT, **params)])[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    # Tokens 0, 1 (prompt), 3, 4 (output) are penalized; 2 and 5 are not.
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2, -2.0 * 2, 1.0]
    assert penalized(repetition_penalty=2.0).tolist() == expected


def test_repetition_penalty_below_one_rewards_repeats() -> None:
    expected = [2.0 / 0.5, -1.0 * 0.5, 0.5, 3.0 / 0.5, -2.0 * 0.5, 1.0]
    assert penalized(repetition_penalty=0.5).tolist() == expected


def test_frequency_penalty_counts_output_occurrences_only() -> None:
    expected = [2.0, -1.0, 0.5, 3.0 - 2 * 0.5, -2.0 - 1 * 0.5, 1.0]
    assert penalized(frequency_penalty=0.5).tolist() == expected


def test_presence_penalty_once_per_output_token() -> None:
    expected = torch.tensor([2.0, -1.0, 0.5, 3.0 - 0.75, -2.0 - 0.75, 1.0])
    assert torch.equal(penalized(presence_penalty=0.75), expected)


def test_negative_frequency_penalty_rewards_repeats() -> None:
    expected = [2.0, -1.0, 0.5, 3.0 + 2 * 1.5, -2.0 + 1.5, 1.0]
    assert penalized(frequency_penalty=-1.5).tolist() == expected


def test_penalties_compose_repetition_first() -> None:
    got = penalized(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 1.0])
    assert torch.allclose(got, expected)


def test_rows_without_penalties_are_untouched_in_a_penalized_batch() -> None:
    rows = [
        make_row(prompt=PROMPT, output=OUTPUT, repetition_penalty=2.0),
        make_row(prompt=PROMPT, output=OUTPUT),
        make_row(prompt=[0, 1, 2, 3, 4, 5], output=[5, 5, 5, 5], frequency_penalty=1.0),
    ]
    got = processed(rows)
    assert got[1].tolist() == LOGITS
    assert got[2].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 1.0 - 4.0]


def test_out_of_vocab_ids_in_history_are_ignored() -> None:
    row = make_row(
        prompt=[0, 99], output=[3, 6, 1000], repetition_penalty=2.0, frequency_penalty=1.0
    )
    assert processed([row])[0].tolist() == [1.0, -1.0, 0.5, 1.5 - 1.0, -2.0, 1.0]


@pytest.mark.parametrize(
    "params",
    [{"repetition_penalty": 2.0}, {"frequency_penalty": 0.6}, {"presence_penalty": 1.0}],
)
def test_penalty_flips_the_greedy_choice(params: dict) -> None:
    logits = torch.tensor([[1.0, 1.5, 0.0]])
    plain = make_row(output=[1], temperature=0.0)
    penalized_row = make_row(output=[1], temperature=0.0, **params)
    assert Sampler()(logits, [plain]).sampled_token_ids.tolist() == [1]
    assert Sampler()(logits, [penalized_row]).sampled_token_ids.tolist() == [0]
