"""Gated activations of the feed-forward block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input holds ``[gate | up]`` along its last dimension.

    Takes the output of a merged gate/up projection, so the MLP needs one matmul for both.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
