"""Tolerances and comparisons of the conformance suite, per dtype.

Kernels are compared with the float32 torch reference on inputs already rounded to the
kernel's dtype, so the tolerance covers only the kernel's own rounding (16-bit kernels round
the softmax probabilities and the output). End to end, float32 runs must reproduce Hugging
Face's greedy token ids exactly; 16-bit runs cannot (one rounding flips a near tie and the rest
of the sequence differs), so each token they choose must be the reference's argmax up to the
dtype's logprob tolerance, judged with the reference fed the backend's own tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Absolute and relative tolerance of one comparison."""

    atol: float
    rtol: float


# Attention output against octavo.attention.reference.paged_attention_reference.
KERNEL_TOLERANCES = {
    "float32": Tolerance(2e-4, 2e-4),
    "float16": Tolerance(4e-3, 4e-3),
    "bfloat16": Tolerance(3e-2, 3e-2),
}

# Logprobs against Hugging Face's log_softmax on the same weights. float32 leaves room for a
# different reduction order and fused kernels. The 16-bit values are about 5x the largest
# error of the CPU backend on the suite's tiny models (0.021 in bfloat16, 0.003 in float16).
LOGPROB_ATOL = {
    "float32": 1e-3,
    "float16": 0.02,
    "bfloat16": 0.1,
}


def assert_kernel_close(actual: torch.Tensor, expected: torch.Tensor, dtype: str, what: str) -> None:
    """``actual`` (any device, the kernel's dtype) equals ``expected`` within ``dtype``'s tolerance."""
    tol = KERNEL_TOLERANCES[dtype]
    actual = actual.detach().to("cpu", torch.float32)
    assert torch.isfinite(actual).all(), (
        f"{what}: non-finite values; an unwritten cache slot or padding reached the result"
    )
    torch.testing.assert_close(actual, expected.float(), atol=tol.atol, rtol=tol.rtol,
                               msg=lambda m: f"{what}: {m}")


def assert_greedy_choices(
    reference: torch.Tensor,  # [num_tokens, vocab] float32 log-probabilities
    token_ids: Sequence[int],
    dtype: str,
    what: str,
) -> None:
    """Each chosen token is the reference's most likely one, up to ``dtype``'s tolerance.

    ``reference[i]`` is the distribution the backend sampled ``token_ids[i]`` from, computed
    by the reference on the same prefix (including the backend's own earlier tokens).
    """
    atol = LOGPROB_ATOL[dtype]
    for i, token_id in enumerate(token_ids):
        best = reference[i].max().item()
        chosen = reference[i, token_id].item()
        assert best - chosen <= atol, (
            f"{what}: token {i} is {token_id} (reference logprob {chosen:.5f}), but the "
            f"reference's argmax {int(reference[i].argmax())} has {best:.5f}; more than the "
            f"{dtype} tolerance {atol} apart, so this is not a near tie"
        )


def assert_logprobs_close(
    positions: Sequence[Mapping[int, Any] | None],
    reference: torch.Tensor,  # [num_positions, vocab] float32 log-probabilities
    dtype: str,
    what: str,
) -> None:
    """Every logprob a backend returned (chosen and top tokens) is close to the reference's.

    ``positions`` are ``RequestOutput`` logprob dicts (token id -> ``Logprob``); ``None``
    entries (the first prompt token) are skipped together with their reference row.
    """
    atol = LOGPROB_ATOL[dtype]
    assert len(positions) == reference.shape[0], (
        f"{what}: {len(positions)} logprob positions, reference has {reference.shape[0]}"
    )
    for i, position in enumerate(positions):
        if position is None:
            continue
        for token_id, logprob in position.items():
            expected = reference[i, token_id].item()
            assert abs(logprob.logprob - expected) <= atol, (
                f"{what}: position {i}, token {token_id}: logprob {logprob.logprob:.5f}, "
                f"reference {expected:.5f} (tolerance {atol} for {dtype})"
            )


def assert_top_tokens(
    position: Mapping[int, Any],
    reference: torch.Tensor,  # [vocab] float32 log-probabilities
    chosen: int,
    k: int,
    dtype: str,
    what: str,
) -> None:
    """``position`` holds the chosen token and ``k`` top tokens, each among the reference's
    top ``k`` up to the logprob tolerance (a near tie at the k-th place may go either way)."""
    assert chosen in position, f"{what}: the chosen token {chosen} is missing"
    # k entries when the chosen token is one of the top k, else k + 1.
    assert len(position) in (k, k + 1), f"{what}: {len(position)} tokens for top-{k}"
    if k:
        kth_best = torch.topk(reference, k).values[-1].item()
        for token_id in set(position) - {chosen}:
            assert reference[token_id].item() >= kth_best - LOGPROB_ATOL[dtype], (
                f"{what}: token {token_id} is returned as a top-{k} token but is not one"
            )


class GreedyEquivalence:
    """Checks that a run's greedy outputs are equivalent to a reference run's.

    float32: the token ids are identical. 16-bit: batch shape, chunking or preemption change
    the rounding, so each run's choices are instead checked against Hugging Face on the same
    weights (``assert_greedy_choices``); the reference run is then not needed.
    """

    def __init__(self, model_folder: Path, dtype: str) -> None:
        self.model_folder = model_folder
        self.dtype = dtype
        self._hf: Any = None

    def check(
        self,
        prompts: Sequence[list[int]],
        ids: Sequence[list[int]],
        expected: Sequence[list[int]],
        what: str,
    ) -> None:
        assert len(ids) == len(prompts), f"{what}: {len(ids)} outputs for {len(prompts)} prompts"
        if self.dtype == "float32":
            for n, (got, want) in enumerate(zip(ids, expected)):
                assert list(got) == list(want), f"{what}, prompt {n}: greedy ids differ"
            return
        if self._hf is None:
            from octavo.testing.hf_reference import HFReference

            self._hf = HFReference(self.model_folder, self.dtype)
        for n, (prompt, generated) in enumerate(zip(prompts, ids)):
            logprobs = self._hf.next_token_logprobs(list(prompt) + list(generated))
            assert_greedy_choices(logprobs[len(prompt) - 1 : -1], generated, self.dtype,
                                  f"{what}, prompt {n}")
