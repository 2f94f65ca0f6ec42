"""``GraphRunner``: the extension point for replaying captured steps (e.g. CUDA graphs).

A worker that can capture whole forward passes (``Worker.make_graph_runner``) gives the model
runner one of these once the KV cache exists; the runner then asks it, step by step, whether
it can run the step, and falls back to the eager forward when it cannot.
"""

from __future__ import annotations

from typing import Protocol

import torch

from octavo.attention.base import AttentionMetadata


class GraphRunner(Protocol):
    """Replays captured forward passes for the steps it covers."""

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether this step (as ``metadata`` describes it) can be replayed."""
        ...

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """The model's hidden states for this step, exactly as the eager forward gives them."""
        ...
