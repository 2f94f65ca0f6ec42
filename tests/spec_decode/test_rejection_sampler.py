"""The batched rejection sampler: greedy rule, the accept/resample rule's output distribution
(chi-square against the target's), and plain rows drawn exactly as the plain sampler does."""

from __future__ import annotations

import pytest
import torch
from octavo.sample.sampler import exponential_race
from octavo.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    rejection_sample,
    target_distribution,
)

from tests.helpers.spec_sampling import chi_square_p_value


def _rows(drafts: list[list[int]]) -> torch.Tensor:
    """Flat draft ids: each request's drafts, then -1 on its last row."""
    return torch.tensor([t for d in drafts for t in d + [-1]], dtype=torch.long)


def test_greedy_accepts_while_draft_equals_argmax() -> None:
    drafts = [[5, 6, 7], [], [1, 2], [3]]
    argmax = torch.tensor([5, 6, 9, 0,   # accepts 5, 6; rejects 7: emits 9
                           4,            # no draft: plain argmax
                           1, 2, 8,      # accepts both: bonus 8
                           2, 3])        # rejects 3 at once: emits 2
    out = rejection_sample(argmax, None, None, _rows(drafts), [len(d) for d in drafts])
    P = PLACEHOLDER_TOKEN_ID
    assert out.token_ids.tolist() == [[5, 6, 9, P], [4, P, P, P], [1, 2, 8, P], [2, P, P, P]]
    assert out.num_emitted.tolist() == [3, 1, 3, 1]
    # Per row: the token emitted at that position (rows past the last emitted: any token).
    assert out.row_token_ids.tolist()[:3] == [5, 6, 9]
    assert out.row_token_ids.tolist()[4] == 4
    assert out.row_token_ids.tolist()[5:8] == [1, 2, 8]
    assert out.row_token_ids.tolist()[8] == 2


def test_mismatched_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(torch.zeros(3, dtype=torch.long), None, None, _rows([[1]]), [1])


def _first_tokens(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor,
                  num_trials: int, p_next: torch.Tensor) -> torch.Tensor:
    """num_trials independent requests of one draft token each (drawn from q, or fixed); the
    first emitted token of each."""
    vocab = p.shape[0]
    rows = torch.stack([p, p_next]).repeat(num_trials, 1)  # [2 * trials, vocab]
    flat_drafts = torch.stack([draft, torch.full_like(draft, -1)], dim=1).reshape(-1)
    draft_probs = None
    if q is not None:
        draft_probs = torch.stack([q, torch.zeros(vocab)]).repeat(num_trials, 1)
    out = rejection_sample(rows.argmax(dim=1), rows, torch.zeros(2 * num_trials, dtype=torch.bool),
                           flat_drafts, [1] * num_trials, draft_probs=draft_probs)
    return out.token_ids[:, 0]


def test_output_distribution_equals_the_targets_for_a_sampled_draft() -> None:
    """Drafts drawn from a q far from p; the first emitted token must still be ~ p."""
    torch.manual_seed(0)
    p = torch.tensor([0.05, 0.10, 0.40, 0.15, 0.30])
    q = torch.tensor([0.40, 0.30, 0.05, 0.20, 0.05])
    trials = 40_000
    draft = torch.multinomial(q, trials, replacement=True)
    first = _first_tokens(p, q, draft, trials, p_next=torch.full((5,), 0.2))
    counts = torch.bincount(first, minlength=5).double()
    p_value = chi_square_p_value(counts, p)
    assert p_value > 1e-3, (counts / trials, p)
    # And it is really speculating: some drafts are accepted, some not.
    accepted = (first == draft).double().mean().item()
    assert 0.2 < accepted < 0.9


def test_output_distribution_equals_the_targets_for_a_deterministic_draft() -> None:
    """ngram drafts are fixed tokens (q one-hot): accepted with probability p(d)."""
    torch.manual_seed(1)
    p = torch.tensor([0.25, 0.05, 0.50, 0.20])
    trials = 40_000
    draft = torch.full((trials,), 2, dtype=torch.long)
    first = _first_tokens(p, None, draft, trials, p_next=torch.full((4,), 0.25))
    counts = torch.bincount(first, minlength=4).double()
    p_value = chi_square_p_value(counts, p)
    assert p_value > 1e-3, (counts / trials, p)


def test_bonus_token_after_all_accepted_is_drawn_from_the_last_row() -> None:
    torch.manual_seed(2)
    p_draft = torch.tensor([0.0, 1.0, 0.0])  # the draft (token 1) is always accepted
    p_next = torch.tensor([0.6, 0.1, 0.3])
    trials = 30_000
    rows = torch.stack([p_draft, p_next]).repeat(trials, 1)
    drafts = torch.tensor([1, -1]).repeat(trials)
    out = rejection_sample(rows.argmax(1), rows, torch.zeros(2 * trials, dtype=torch.bool),
                           drafts, [1] * trials)
    assert (out.num_emitted == 2).all()
    assert (out.token_ids[:, 0] == 1).all()
    first_two = out.token_ids[:, 1]
    counts = torch.bincount(first_two, minlength=3).double()
    p_value = chi_square_p_value(counts, p_next)
    assert p_value > 1e-3


def test_plain_rows_draw_as_the_plain_sampler_with_seeds() -> None:
    """A request with no draft and a seed gets exactly the plain sampler's token."""
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(3)), dim=1)
    seeded = [(0, 11), (1, 12), (2, 13)]
    expected = exponential_race(probs.clone(), seeded)
    out = rejection_sample(probs.argmax(1), probs, torch.zeros(3, dtype=torch.bool),
                           torch.full((3,), -1), [0, 0, 0], seeded_rows=seeded)
    assert out.token_ids[:, 0].tolist() == expected.tolist()


def test_mixed_greedy_and_sampled_requests() -> None:
    torch.manual_seed(4)
    vocab = 6
    probs = torch.softmax(torch.randn(5, vocab), dim=1)
    argmax = probs.argmax(1)
    # Request 0 greedy with drafts equal to the argmax (all accepted), request 1 sampled with
    # a draft of probability 0 (always rejected).
    zero_token = 5
    probs[3, zero_token] = 0.0
    probs[3] /= probs[3].sum()
    drafts = torch.tensor([int(argmax[0]), int(argmax[1]), -1, zero_token, -1])
    is_greedy = torch.tensor([True, True, True, False, False])
    out = rejection_sample(argmax, probs, is_greedy, drafts, [2, 1])
    assert out.num_emitted.tolist() == [3, 1]
    assert out.token_ids[0].tolist() == argmax[:3].tolist()
    assert out.token_ids[1, 0].item() != zero_token


def test_target_distribution_matches_the_sampler() -> None:
    """target_distribution's probs are what the plain sampler samples from."""
    from octavo.sample.metadata import SamplingMetadata, SamplingRow
    from octavo.sample.sampler import Sampler
    from octavo.sampling_params import SamplingParams

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    rows = [SamplingRow(SamplingParams(temperature=0.0, max_tokens=4), [1, 2], []),
            SamplingRow(SamplingParams(temperature=0.7, top_k=5, max_tokens=4), [1], [3]),
            SamplingRow(SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.5,
                                       max_tokens=4), [1], [3, 4])]
    sampler = Sampler()
    metadata = SamplingMetadata.from_rows(rows, 40, logits.device)
    argmax, probs, greedy = target_distribution(sampler, logits, metadata)
    assert greedy.tolist() == [True, False, False]
    assert argmax[0].item() == logits[0].argmax().item()
    assert torch.allclose(probs.sum(1), torch.ones(3))
    assert int((probs[1] > 0).sum()) == 5  # top-k 5
    # Seeded draws from these probs reproduce the plain sampler's seeded tokens.
    seeded_rows = [(1, 21), (2, 22)]
    rows[1].params.seed, rows[2].params.seed = 21, 22
    metadata = SamplingMetadata.from_rows(rows, 40, logits.device)
    plain = sampler.sample(logits, metadata).sampled_token_ids
    _, probs, _ = target_distribution(sampler, logits, metadata)
    drawn = exponential_race(probs, metadata.seeded_rows)
    assert drawn[1:].tolist() == plain[1:].tolist()
    assert seeded_rows  # (the rows above are the seeded ones)
