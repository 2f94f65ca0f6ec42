"""Greedy argmax of the sampled rows' logits: ``torch.argmax(logits, dim=-1)``, or for a few
rows on an NVIDIA GPU the two-kernel Triton argmax (``octavo.kernels.triton.argmax``), which
splits each row over many programs where torch's reduction walks it with few (at batch 1 on an
H100, 27.5 µs of GPU time a step for a 128,256-token vocabulary, on the path to the next
step). ``OCTAVO_ARGMAX_KERNEL=0`` keeps torch's everywhere.

Importable without Triton: the kernel module is imported on first use.
"""

from __future__ import annotations

import functools

import torch

from octavo import envs
from octavo.kernels.triton_support import optional_triton_kernels

#: Rows up to which the Triton argmax runs (more rows give torch's reduction enough blocks).
MAX_KERNEL_ROWS = 16


@functools.cache
def _kernel_module():
    """The Triton argmax's module, or None (switched off, or no Triton); read once."""
    return optional_triton_kernels("argmax") if envs.argmax_kernel() else None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows]
    """The first index of each row's largest logit, int64 (``torch.argmax(logits, dim=-1)``)."""
    if (logits.device.type == "cuda" and torch.version.hip is None and logits.dim() == 2
            and 0 < logits.shape[0] <= MAX_KERNEL_ROWS and logits.stride(1) == 1):
        kernel = _kernel_module()
        if kernel is not None:
            return kernel.argmax_rows(logits)
    return logits.argmax(dim=-1)
