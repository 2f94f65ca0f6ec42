"""``TorchKVBlockMover`` against plain per-block torch copies: swap out, copy, swap in (on the
CPU here; on CUDA, with pinned host memory and non-blocking copies, in the gpu-marked test)."""

from __future__ import annotations

import pytest
import torch
from octavo.worker.kv_block_mover import TorchKVBlockMover

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def check_mover(device: str, block_dim: int = 1, dtype: torch.dtype = torch.float32) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = [2, 10, 4, 2, 8]  # (k/v, blocks, block size, heads, head dim)
    if block_dim == 0:
        shape = [10, 2, 4, 2, 8]
    caches = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(3)]
    reference = [c.cpu().clone() for c in caches]
    mover = TorchKVBlockMover(block_dim, torch.device(device))
    host = mover.allocate_host_cache(caches, 6)
    assert host[0].device.type == "cpu" and host[0].shape[block_dim] == 6
    assert host[0].is_pinned() == (device == "cuda")
    ref_host = [torch.zeros_like(h) for h in host]

    def block(t, i):
        return t.select(block_dim, i)

    out_pairs = [(7, 0), (2, 5), (9, 3)]
    mover.swap_out(caches, host, out_pairs)
    for ref, ref_h in zip(reference, ref_host):
        for s, d in out_pairs:
            block(ref_h, d).copy_(block(ref, s))
    # The device blocks are reused at once (the next forward writes them): the swap-out must
    # have read them first.
    for cache in caches:
        block(cache, 7).fill_(-1.0)
    for ref in reference:
        block(ref, 7).fill_(-1.0)
    copy_pairs = [(1, 4), (4, 8)]  # reads all sources before writing: 4 is read, then written
    mover.copy(caches, copy_pairs)
    for ref in reference:
        sources = [block(ref, s).clone() for s, _ in copy_pairs]
        for (_, d), src in zip(copy_pairs, sources):
            block(ref, d).copy_(src)
    in_pairs = [(0, 6), (3, 7), (5, 2)]
    mover.swap_in(host, caches, in_pairs)
    for ref, ref_h in zip(reference, ref_host):
        for s, d in in_pairs:
            block(ref, d).copy_(block(ref_h, s))
    for cache, ref in zip(caches, reference):
        assert cache.dtype == dtype
        assert torch.equal(cache.cpu().view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("block_dim", [0, 1])
def test_moves_equal_per_block_copies_on_the_cpu(block_dim: int) -> None:
    check_mover("cpu", block_dim)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_fp8_cache_moves_as_bytes(block_dim: int) -> None:
    """``--kv-cache-dtype fp8``: torch has no CPU index_copy_ for float8; the mover copies the
    bytes, so the blocks come back bit for bit."""
    check_mover("cpu", block_dim, torch.float8_e4m3fn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("block_dim", [0, 1])
def test_moves_equal_per_block_copies_on_cuda(block_dim: int) -> None:
    check_mover("cuda", block_dim)
