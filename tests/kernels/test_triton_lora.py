"""The Triton LoRA shrink/expand kernels against the torch reference (``lora_torch``).

On CPU they run under ``TRITON_INTERPRET=1`` (set by ``tests.kernels.conftest``) at tiny
shapes; the ``gpu`` case runs a Llama-3-8B-sized layer on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from octavo.kernels.triton.lora import lora_shrink_expand
from octavo.lora.layers import LoRAMapping, lora_torch
from tests.kernels.conftest import DEVICE, DTYPES, TOLERANCES


def _case(slots: list[int], lengths: list[int], k: int, n: int, rank: int, num_slots: int,
          dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEVICE)
    out = torch.randn(tokens, n, generator=gen).to(dtype).to(DEVICE)
    lora_a = (torch.randn(num_slots, rank, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    lora_b = torch.randn(num_slots, n, rank, generator=gen).to(dtype).to(DEVICE)
    mapping = LoRAMapping.from_requests(slots, lengths, torch.device(DEVICE))
    return x, out, lora_a, lora_b, mapping


def _check(slots, lengths, k, n, rank, num_slots, dtype, block_m=16):
    x, out, lora_a, lora_b, mapping = _case(slots, lengths, k, n, rank, num_slots, dtype)
    expected = out.float().clone()
    lora_torch(x.float(), expected, lora_a.float(), lora_b.float(), mapping)
    got = out.clone()
    lora_shrink_expand(x, got, lora_a, lora_b, mapping.token_indices, mapping.group_slots_dev,
                       mapping.group_starts_dev, len(mapping.group_slots),
                       mapping.max_group_size, block_m=block_m)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol * 4, rtol=rtol * 4)
    # Rows of no adapter are untouched, bit for bit.
    start = 0
    for slot, length in zip(slots, lengths):
        if slot < 0:
            assert torch.equal(got[start:start + length], out[start:start + length])
        start += length


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_and_decode(dtype):
    # Two prompts (one longer than a block of rows), decodes of three slots, rows of none.
    _check([0, -1, 2, 0, 1, -1, 2], [19, 3, 5, 1, 1, 1, 1], k=40, n=72, rank=24, num_slots=3,
           dtype=dtype)


def test_rank_padding_and_single_slot():
    # R not a power of two, N smaller than a block, one slot for every row.
    _check([1, 1, 1], [1, 2, 1], k=16, n=10, rank=6, num_slots=2, dtype=torch.float32)


def test_inputs_split_over_programs():
    # K over SHRINK_K_CHUNK: three programs per row block add their partial sums, the last
    # one over a partial chunk.
    from octavo.kernels.triton.lora import SHRINK_K_CHUNK

    k = 2 * SHRINK_K_CHUNK + 76
    _check([0, 1, -1, 0], [5, 3, 2, 1], k=k, n=24, rank=8, num_slots=2, dtype=torch.float32)


def test_nothing_mapped():
    assert LoRAMapping.from_requests([-1, -1], [3, 1], torch.device(DEVICE)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096)])
def test_llama8b_shapes(dtype, k, n):
    # 4 adapters of rank 16 with merged shards (R = 3 * 16 for QKV): a mixed step of 2
    # prompts and 60 decodes.
    slots = [0, 1] + [i % 4 for i in range(60)]
    lengths = [300, 77] + [1] * 60
    _check(slots, lengths, k=k, n=n, rank=48, num_slots=4, dtype=dtype)
