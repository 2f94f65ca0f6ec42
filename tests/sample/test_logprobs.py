"""``compute_logprobs`` and the logprobs the sampler returns."""

from __future__ import annotations

import pytest
import torch

from octavo.sample import Sampler, compute_logprobs
from tests.sample.helpers import make_row, random_logits

VOCAB = 32


def test_values_equal_log_softmax_and_top_k_is_sorted() -> None:
    logits = random_logits(5, VOCAB)
    chosen = torch.tensor([0, 3, 7, 31, 12])
    out = compute_logprobs(logits, chosen, num_top=4)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.shape == (5, 5) and out.token_ids.dtype == torch.int64
    assert out.logprobs.dtype == torch.float32
    assert out.token_ids[:, 0].tolist() == chosen.tolist()
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids))
    top = out.logprobs[:, 1:]
    assert torch.all(top[:, :-1] >= top[:, 1:])
    assert out.token_ids[:, 1].tolist() == logits.argmax(dim=-1).tolist()
    assert torch.allclose(top, reference.topk(4, dim=-1).values)


def test_ranks() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.3], [2.0, 1.0, 2.0, 0.0]])
    for token, rank in [(1, 1), (2, 2), (3, 3), (0, 4)]:
        ranks = compute_logprobs(logits[:1], torch.tensor([token]), 0).ranks
        assert ranks.tolist() == [rank], token
    # Ties share the best rank.
    assert compute_logprobs(logits[1:], torch.tensor([2]), 0).ranks.tolist() == [1]


def test_num_top_zero_and_bad_values() -> None:
    logits = random_logits(2, VOCAB)
    out = compute_logprobs(logits, torch.tensor([1, 2]), 0)
    assert out.token_ids.shape == (2, 1) and out.logprobs.shape == (2, 1)
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, torch.tensor([1, 2]), VOCAB + 1)
    with pytest.raises(ValueError, match="chosen_token_ids"):
        compute_logprobs(logits, torch.tensor([1]), 1)


def test_half_precision_is_computed_in_float32() -> None:
    logits = random_logits(2, VOCAB).to(torch.bfloat16)
    out = compute_logprobs(logits, torch.tensor([0, 1]), 2)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids))


def test_sampler_logprobs_use_raw_logits_and_max_k() -> None:
    logits = random_logits(3, VOCAB)
    rows = [
        make_row(logprobs=2, temperature=0.3, repetition_penalty=1.7, prompt=[1, 2, 3]),
        make_row(temperature=0.0, logit_bias={5: 50.0}),
        make_row(logprobs=5, seed=3, frequency_penalty=2.0, output=[4, 4]),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs is not None
    sampled = out.sampled_token_ids
    expected = compute_logprobs(logits, sampled, 5)
    assert out.logprobs.token_ids.shape == (3, 6)
    assert torch.equal(out.logprobs.token_ids, expected.token_ids)
    assert torch.allclose(out.logprobs.logprobs, expected.logprobs)
    assert torch.equal(out.logprobs.ranks, expected.ranks)
    assert out.logprobs.token_ids[1, 0].item() == 5  # the biased choice, with its raw logprob


def test_no_logprobs_when_no_row_asks() -> None:
    out = Sampler()(random_logits(2, VOCAB), [make_row(), make_row(temperature=0.0)])
    assert out.logprobs is None


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    out = Sampler()(random_logits(2, VOCAB), [make_row(logprobs=0), make_row()])
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (2, 1)


def test_more_logprobs_than_vocab_are_clamped() -> None:
    out = Sampler()(random_logits(1, VOCAB), [make_row(logprobs=VOCAB + 10)])
    assert out.logprobs is not None and out.logprobs.token_ids.shape == (1, VOCAB + 1)
