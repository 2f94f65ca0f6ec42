"""Shared setup for the kernel tests: Triton interpreter on CPU, random paged batches.

Test modules import the helpers below (``from tests.kernels.conftest import ...``; pytest
imports this file under that same name, so the environment is set exactly once).

Without CUDA, ``TRITON_INTERPRET=1`` is set here, at conftest import time, before any test
module imports Triton (``triton.jit`` reads it when a kernel is defined), so the kernels run on
CPU tensors. Tests marked ``gpu`` (full shapes) are skipped without CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_CUDA else "cpu"

# (atol, rtol) against the float32 torch reference. 16-bit kernels round the softmax
# probabilities to the input dtype before the P @ V dot, and the output to the input dtype.
TOLERANCES = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

# Dtypes the kernels are tested with. The CPU interpreter computes bf16 dots wrongly, so the
# kernels upcast them there (see octavo.kernels.triton.cache_write.upcast_dot); fp16 runs as is.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests when CUDA is unavailable."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (full-shape parametrization)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass(slots=True)
class PagedBatch:
    """A random step: new tokens of several sequences plus a cache holding their prefixes."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    # [2, num_blocks, block_size, num_kv_heads, head_dim], random everywhere (prefixes and
    # unused blocks alike), new tokens not yet written.
    kv_cache: torch.Tensor
    metadata: "AttentionMetadata"  # noqa: F821
    scale: float
    # Number of rows of the flat batch that belong to a sequence (the rest is padding).
    num_real_tokens: int


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_padding_tokens: int = 0,
    shared_first_block: tuple[int, int] | None = None,
    seed: int = 0,
    device: str = DEVICE,
) -> PagedBatch:
    """Build a random batch whose block tables are shuffled, scattered block ids.

    ``num_padding_tokens`` rows with slot ``-1`` are appended after the real tokens.
    ``shared_first_block=(i, j)`` makes sequence ``j`` reuse sequence ``i``'s first block as
    its (cached) first block, i.e. a shared prefix that sequence ``i`` may write this step.
    """
    from octavo.attention.base import AttentionMetadata

    assert len(query_lens) == len(seq_lens), "one query length per sequence"
    assert all(0 <= q <= s for q, s in zip(query_lens, seq_lens)), "query_len <= seq_len"
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq, default=0)
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks hold random junk the kernels must skip
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()
    # Two spare columns: rows are padded with 0 like the model runner does.
    block_tables = torch.zeros((num_seqs, max_blocks + 2), dtype=torch.int32)
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = torch.tensor([block_ids.pop() for _ in range(count)])
    if shared_first_block is not None:
        src, dst = shared_first_block
        block_tables[dst, 0] = block_tables[src, 0]

    slots = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s_len - q_len, s_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * num_padding_tokens
    num_tokens = len(slots)
    query_start_loc = [0]
    for q_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    metadata = AttentionMetadata.from_lists(slots, query_start_loc, list(seq_lens),
                                            block_tables, device=device)
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim).to(device),
        key=randn(num_tokens, num_kv_heads, head_dim).to(device),
        value=randn(num_tokens, num_kv_heads, head_dim).to(device),
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(device),
        metadata=metadata,
        scale=head_dim**-0.5,
        num_real_tokens=query_start_loc[-1],
    )


def on_device_of(tensor: torch.Tensor) -> torch.device:
    """Context manager making ``tensor``'s device the default for new tensors.

    ``paged_attention_reference`` builds its causal-mask positions with ``torch.arange`` on
    the default device; run under this it also works on CUDA tensors.
    """
    return torch.device(tensor.device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare with the per-dtype tolerances of ``TOLERANCES``."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
