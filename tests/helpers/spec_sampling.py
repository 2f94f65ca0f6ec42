"""Statistical checks that speculative sampling keeps the target's distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.engine import make_llm


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (cells with p > 0)."""
    keep = probs > 0
    expected = probs.double()[keep] * counts.sum()
    observed = counts.double()[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    assert (counts.double()[~keep] == 0).all(), "a token of probability 0 was emitted"
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def assert_second_token_follows_target(folder: Path, speculative_config: dict[str, Any],
                                       trials: int = 3000, temperature: float = 0.7) -> None:
    """Sample ``trials`` requests of ``max_tokens`` 3 from the model in ``folder`` with
    ``speculative_config`` (K = 2): each one's second token comes from a verifying step (room
    for one draft, accepted or resampled). Assert both rules ran and that the second tokens'
    frequencies match the target's marginal ``sum_t1 p(t1) p(t2 | t1)``, computed with
    transformers on the same weights (Pearson's chi-square; cells expecting under 5 draws
    pooled)."""
    from octavo.sampling_params import SamplingParams
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8, 9]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = first.shape[0]
        both = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.softmax(model(both).logits[:, -1] / temperature, -1)  # [t1, t2]
    marginal = first @ second
    llm = make_llm(folder, speculative_config=speculative_config, enable_prefix_caching=False)
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([prompt] * trials, params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    # Both rules at work: accepted drafts and resampled rejections.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts == trials
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outputs]),
                            minlength=vocab)
    big = marginal * trials >= 5
    pooled_counts = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    pooled_probs = torch.cat([marginal[big], marginal[~big].sum().reshape(1)])
    assert chi_square_p_value(pooled_counts, pooled_probs) > 1e-3
