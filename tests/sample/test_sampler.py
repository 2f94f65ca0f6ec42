"""Behaviour of ``Sampler``: each parameter, seeding, batching and sampling frequencies."""

from __future__ import annotations

import pytest
import torch

from octavo.sample import Sampler, SamplingRow
from octavo.sample.sampler import apply_min_p, apply_top_k_top_p
from tests.sample.helpers import log_probs, make_row, random_logits

VOCAB = 64
EOS = 2
STOP = 5


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return Sampler()(logits, rows).sampled_token_ids.tolist()


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
    return counts / len(tokens)


# --- greedy, temperature, top-k, top-p, min-p -------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(16, VOCAB)
    tokens = sample(logits, [make_row(temperature=0.0) for _ in range(16)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_output_is_int64_on_logits_device_and_logits_untouched() -> None:
    logits = random_logits(3, VOCAB)
    before = logits.clone()
    rows = [make_row(repetition_penalty=1.5, prompt=[1, 2], logit_bias={3: 9.0}) for _ in range(3)]
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.shape == (3,)
    assert out.sampled_token_ids.device == logits.device
    assert torch.equal(logits, before)


def test_tiny_temperature_matches_greedy() -> None:
    logits = random_logits(16, VOCAB, scale=3.0)
    greedy = logits.argmax(dim=-1).tolist()
    # 1e-6 counts as greedy; 1e-3 is sampled, but the distribution is a spike on the argmax.
    assert sample(logits, [make_row(temperature=1e-6) for _ in range(16)]) == greedy
    assert sample(logits, [make_row(temperature=1e-3) for _ in range(16)]) == greedy


def test_top_k_1_is_greedy() -> None:
    logits = random_logits(32, VOCAB)
    rows = [make_row(temperature=1.5, top_k=1) for _ in range(32)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(32, VOCAB)
    rows = [make_row(temperature=1.0, top_p=1e-4) for _ in range(32)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_top_k_top_p_masks() -> None:
    logits = log_probs([0.15, 0.5, 0.05, 0.3])
    both = torch.cat([logits, logits, logits])
    top_k = torch.tensor([2, 4, 4])
    top_p = torch.tensor([1.0, 0.75, 0.85])
    kept = apply_top_k_top_p(both, top_k, top_p).isfinite()
    assert kept[0].tolist() == [False, True, False, True]  # top-2
    assert kept[1].tolist() == [False, True, False, True]  # 0.5 + 0.3 reaches 0.75
    assert kept[2].tolist() == [True, True, False, True]  # 0.85 needs 0.15 too
    assert torch.equal(apply_top_k_top_p(both, top_k, top_p)[kept], both[kept])


def test_top_k_keeps_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([2]), None).isfinite()
    assert kept[0].tolist() == [False, True, True, True, False]


def test_min_p_mask() -> None:
    logits = log_probs([0.4, 0.1, 0.3, 0.2])
    masked = logits.clone()
    apply_min_p(masked, torch.tensor([0.6]))  # threshold 0.24
    assert masked.isfinite()[0].tolist() == [True, False, True, False]
    untouched = logits.clone()
    apply_min_p(untouched, torch.tensor([0.0]))
    assert torch.equal(untouched, logits)


def test_min_p_is_applied_by_the_sampler() -> None:
    logits = log_probs([0.4, 0.1, 0.3, 0.2]).expand(500, 4)
    tokens = sample(logits, [make_row(min_p=0.6) for _ in range(500)])
    assert set(tokens) == {0, 2}


# --- logit bias and min_tokens -----------------------------------------------------------------


def test_logit_bias_forces_a_token() -> None:
    logits = random_logits(8, VOCAB)
    rows = [make_row(temperature=t, logit_bias={7: 100.0}) for t in (0.0, 1.0) * 4]
    assert sample(logits, rows) == [7] * 8


def test_logit_bias_ignores_out_of_vocab_ids() -> None:
    logits = random_logits(2, VOCAB)
    rows = [make_row(temperature=0.0, logit_bias={VOCAB: 100.0, VOCAB + 50: 100.0})] * 2
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


def eos_heavy_logits(batch: int) -> torch.Tensor:
    logits = torch.zeros(batch, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, STOP] = 9.0
    logits[:, 11] = 8.0
    return logits


def stop_row(num_output: int, **params: object) -> SamplingRow:
    row = make_row(output=[20] * num_output, temperature=0.0, stop_token_ids=[STOP], **params)
    row.params.all_stop_token_ids = {EOS}
    return row


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    rows = [stop_row(n, min_tokens=3) for n in (0, 2, 3, 4)]
    assert sample(eos_heavy_logits(4), rows) == [11, 11, EOS, EOS]


def test_min_tokens_with_ignore_eos_masks_only_stop_ids() -> None:
    rows = [stop_row(1, min_tokens=3, ignore_eos=True), stop_row(1, min_tokens=3)]
    assert sample(eos_heavy_logits(2), rows) == [EOS, 11]


def test_min_tokens_beats_logit_bias_and_ignores_out_of_vocab_stop_ids() -> None:
    row = stop_row(0, min_tokens=1, logit_bias={EOS: 100.0})
    row.params.stop_token_ids = [STOP, VOCAB + 3]
    assert sample(eos_heavy_logits(1), [row]) == [11]


# --- seeding -----------------------------------------------------------------------------------


def seeded_logits(seed: int) -> torch.Tensor:
    return random_logits(1, VOCAB, seed=seed, scale=0.5)  # flat: the draw decides the token


def test_seeded_row_same_token_alone_or_in_any_batch() -> None:
    for seed in range(10):
        target = make_row(output=[1] * seed, seed=1000 + seed, temperature=0.9)
        target_logits = seeded_logits(seed)
        alone = sample(target_logits, [target])
        others = [
            make_row(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2, 3]),
            make_row(output=[4, 4], temperature=1.2, top_k=5, frequency_penalty=0.5),
            make_row(output=[9] * 7, seed=7, top_p=0.7, min_p=0.05),
            make_row(temperature=0.7, logit_bias={3: 2.0}, presence_penalty=1.0),
            make_row(output=[1], seed=1000 + seed, temperature=0.9),  # same seed, other position
            make_row(temperature=1.0, min_tokens=5, stop_token_ids=[2]),
            make_row(temperature=0.5, logprobs=3),
        ]
        rows = others[:3] + [target] + others[3:]
        logits = random_logits(8, VOCAB, seed=50 + seed, scale=0.5)
        logits[3] = target_logits[0]
        assert sample(logits, rows)[3] == alone[0], f"seed {seed}"


def test_seeded_tokens_depend_on_seed_and_position_only() -> None:
    logits = seeded_logits(0)
    by_seed = [sample(logits, [make_row(output=[0] * 4, seed=s)])[0] for s in range(20)]
    assert len(set(by_seed)) > 5
    by_position = [sample(logits, [make_row(output=[0] * n, seed=3)])[0] for n in range(20)]
    assert len(set(by_position)) > 5
    # Recomputed after preemption: same seed and position -> same token, whatever the history.
    again = [sample(logits, [make_row(output=[n] * 4, seed=s)])[0] for n, s in enumerate(range(20))]
    assert again == by_seed


def test_seeded_rows_ignore_the_global_rng() -> None:
    logits = seeded_logits(1).expand(4, VOCAB)
    rows = [make_row(output=[0] * n, seed=42) for n in range(4)]
    torch.manual_seed(1)
    first = sample(logits, rows)
    torch.manual_seed(2)
    assert sample(logits, rows) == first


# --- distributions -----------------------------------------------------------------------------

PROBS = [0.5, 0.25, 0.15, 0.1]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, PROBS),
        ({"temperature": 2.0}, [p**0.5 / sum(q**0.5 for q in PROBS) for p in PROBS]),
        ({"top_k": 2}, [2 / 3, 1 / 3, 0.0, 0.0]),
        ({"top_p": 0.7}, [2 / 3, 1 / 3, 0.0, 0.0]),
        ({"min_p": 0.35}, [2 / 3, 1 / 3, 0.0, 0.0]),
    ],
)
def test_unseeded_frequencies_match_probabilities(params: dict, expected: list[float]) -> None:
    torch.manual_seed(0)
    num = 20_000
    logits = log_probs(PROBS).expand(num, 4)
    tokens = sample(logits, [make_row(**params) for _ in range(num)])
    assert torch.allclose(frequencies(tokens, 4), torch.tensor(expected), atol=0.015)


def test_seeded_frequencies_over_many_seeds_match_probabilities() -> None:
    num = 2_000
    logits = log_probs(PROBS).expand(num, 4)
    tokens = sample(logits, [make_row(seed=s) for s in range(num)])
    assert torch.allclose(frequencies(tokens, 4), torch.tensor(PROBS), atol=0.04)


# --- mixed batches -----------------------------------------------------------------------------


def test_mixed_batch_matches_each_row_alone() -> None:
    rows = [
        make_row(temperature=0.0),
        make_row(seed=1, temperature=0.8, top_k=10),
        make_row(temperature=0.0, prompt=[3, 4], output=[5], repetition_penalty=1.8),
        make_row(seed=2, output=[1, 1, 2], frequency_penalty=1.0, presence_penalty=0.5),
        make_row(seed=3, top_p=0.9, min_p=0.02, logit_bias={6: 1.5}),
        make_row(temperature=0.0, output=[7, 7], frequency_penalty=2.0, logit_bias={8: -5.0}),
        make_row(seed=4, temperature=1.3, prompt=[1], repetition_penalty=0.7),
    ]
    logits = random_logits(len(rows), VOCAB, seed=9)
    batched = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]
    assert batched == alone


def test_half_precision_logits() -> None:
    logits = random_logits(4, VOCAB).to(torch.bfloat16)
    rows = [make_row(temperature=0.0), make_row(seed=1), make_row(), make_row(top_k=3)]
    tokens = sample(logits, rows)
    assert tokens[0] == logits.float().argmax(dim=-1)[0].item()


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, VOCAB), [])
    assert out.sampled_token_ids.shape == (0,)
    assert out.logprobs is None


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 sampling rows"):
        Sampler()(random_logits(3, VOCAB), [make_row(), make_row()])
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler()(torch.zeros(VOCAB), [make_row()])
