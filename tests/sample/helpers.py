"""Small builders shared by the sampler tests."""

from __future__ import annotations

import torch
from octavo.sample import SamplingRow
from octavo.sampling_params import SamplingParams


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> SamplingRow:
    """A row with ``SamplingParams(seed=seed, **params)`` (the params carry the row's seed)."""
    sampling_params = SamplingParams(seed=seed, **params)  # type: ignore[arg-type]
    return SamplingRow(
        params=sampling_params,
        prompt_token_ids=list(prompt or []),
        output_token_ids=list(output or []),
    )


def random_logits(batch: int, vocab: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Reproducible ``[batch, vocab]`` float32 logits, independent of the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=generator) * scale


def log_probs(probs: list[float]) -> torch.Tensor:
    """``[1, len(probs)]`` logits whose softmax is ``probs``."""
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)
