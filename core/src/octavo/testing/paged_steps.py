"""Random multi-step paged-attention workloads, as the model runner would feed a kernel.

A workload is a few sequences, each processed in chunks over consecutive steps: a first chunk
is a prompt (or a prefill chunk), later chunks continue after what is already cached (chunked
prefill, a cached prefix) and chunks of one token are decodes. Every step is one flat batch
with slot mapping, query offsets, sequence lengths and scattered block tables, exactly as
``octavo.attention.base`` describes. A sequence may also start on blocks of an earlier sequence
(a shared prefix) that this same step fills, which checks the "write every new K/V before
reading" rule.

Block 0 is never given to a sequence: block-table padding points at it, so a kernel that reads
padding reads a block nobody wrote (NaN in the suite's caches).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from octavo.attention.base import AttentionMetadata


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """One sequence of a workload."""

    # New tokens per step (0: not scheduled in that step); the first non-zero chunk starts
    # after the shared prefix, if any.
    chunks: tuple[int, ...]
    # Index of an earlier sequence whose first blocks this one starts with, and how many.
    shares_blocks_of: int | None = None
    num_shared_blocks: int = 0


@dataclass(slots=True)
class PagedStep:
    """One step of a workload, on the host; ``to_device`` moves what a kernel reads."""

    # [num_tokens, num_heads, head_dim] float32 holding values exactly representable in the
    # workload's dtype (so the float32 reference sees the same numbers as the kernel).
    query: torch.Tensor
    # [num_tokens, num_kv_heads, head_dim], same rounding.
    key: torch.Tensor
    value: torch.Tensor
    # Host metadata (every tensor on the CPU).
    metadata: AttentionMetadata

    def metadata_on(self, device: torch.device) -> AttentionMetadata:
        """The same metadata with its tensors on ``device``."""
        return self.metadata.to(device)


@dataclass(slots=True)
class PagedWorkload:
    """Steps to run in order over one cache of ``num_blocks`` blocks."""

    steps: list[PagedStep]
    num_blocks: int


# Tokens of the longest sequence: past 512, a common partition size of split-K decode kernels.
LONG_CONTEXT = 600


def workload_cases(block_size: int) -> dict[str, list[SequenceSpec]]:
    """The named workloads of the kernel conformance tests, for one block size."""
    bs = block_size
    return {
        # Prompts of many lengths (one token, around block edges, and a long one that split-K
        # decode kernels process in several partitions), then two pure-decode steps that
        # cross block boundaries.
        "prefill-then-decode": [
            SequenceSpec((1, 1, 1)),
            SequenceSpec((bs - 1, 1, 1)),
            SequenceSpec((bs, 1, 1)),
            SequenceSpec((2 * bs + 3, 1, 1)),
            SequenceSpec((5 * bs, 1, 1)),
            SequenceSpec((LONG_CONTEXT, 1, 1)),
        ],
        # Prompts split into chunks that continue after a cached prefix ending mid-block and on
        # a block edge, next to other sequences' decodes.
        "chunked-prefill": [
            SequenceSpec((bs + 3, bs + 2, 5, 1)),
            SequenceSpec((2 * bs, bs, 1, 1)),
            SequenceSpec((7, 1, 1, 1)),
            SequenceSpec((0, 0, 3 * bs + 1, 1)),
        ],
        # Decodes, fresh prompts, one-token prompts and chunks in the same steps.
        "mixed": [
            SequenceSpec((3 * bs + 5, 1, 1)),
            SequenceSpec((9, 7, 1)),
            SequenceSpec((1, 4, 1)),
            SequenceSpec((0, bs - 1, 2)),
        ],
        # The second sequence starts on the first two blocks of the first, filled in the same
        # step; the third on one block of the first, one step later.
        "shared-prefix": [
            SequenceSpec((2 * bs + 3, 1, 1)),
            SequenceSpec((5, 1, 1), shares_blocks_of=0, num_shared_blocks=2),
            SequenceSpec((0, 3, 1), shares_blocks_of=0, num_shared_blocks=1),
        ],
    }


def build_workload(
    specs: list[SequenceSpec],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedWorkload:
    """Lay ``specs`` out on scattered blocks and draw random Q/K/V for every step."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    starts = [_shared_len(spec, block_size) for spec in specs]
    totals = [start + sum(spec.chunks) for start, spec in zip(starts, specs)]
    own_blocks = [-(-total // block_size) - spec.num_shared_blocks
                  for total, spec in zip(totals, specs)]
    num_blocks = 1 + sum(own_blocks) + 3  # block 0 (padding target) and a few never used
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # scattered, unordered block ids, as after many allocations
    tables: list[list[int]] = []
    for i, spec in enumerate(specs):
        shared = []
        if spec.shares_blocks_of is not None:
            assert spec.shares_blocks_of < i, "a sequence shares blocks of an earlier one"
            shared = tables[spec.shares_blocks_of][: spec.num_shared_blocks]
        tables.append(shared + [free.pop() for _ in range(own_blocks[i])])

    def rounded(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(torch.float32)

    steps = []
    done = list(starts)  # tokens of each sequence in the cache so far
    for step in range(max(len(spec.chunks) for spec in specs)):
        rows = [(i, spec.chunks[step]) for i, spec in enumerate(specs)
                if step < len(spec.chunks) and spec.chunks[step] > 0]
        slots, query_start, seq_lens, step_tables = [], [0], [], []
        for i, num_new in rows:
            for pos in range(done[i], done[i] + num_new):
                slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
            done[i] += num_new
            query_start.append(query_start[-1] + num_new)
            seq_lens.append(done[i])
            step_tables.append(tables[i])
        num_tokens = len(slots)
        metadata = AttentionMetadata.from_lists(slots, query_start, seq_lens, _padded(step_tables))
        steps.append(PagedStep(
            query=rounded(num_tokens, num_heads, head_dim),
            key=rounded(num_tokens, num_kv_heads, head_dim),
            value=rounded(num_tokens, num_kv_heads, head_dim),
            metadata=metadata,
        ))
    return PagedWorkload(steps=steps, num_blocks=num_blocks)


def _shared_len(spec: SequenceSpec, block_size: int) -> int:
    return spec.num_shared_blocks * block_size if spec.shares_blocks_of is not None else 0


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """[num_seqs, widest + 1] int32, padded with block 0 like the model runner pads."""
    width = max(len(t) for t in tables) + 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
