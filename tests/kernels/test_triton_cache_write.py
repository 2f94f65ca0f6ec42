"""``write_kv_cache`` against ``write_kv_reference``: a copy, so results must match exactly."""

from __future__ import annotations

import pytest
import torch

from octavo.attention.reference import write_kv_reference
from octavo.kernels.triton import write_kv_cache
from tests.kernels.conftest import DEVICE, DTYPES, make_paged_batch


def _check_write(batch, key=None, value=None):
    key = batch.key if key is None else key
    value = batch.value if value is None else value
    expected = batch.kv_cache.clone()
    write_kv_reference(key, value, expected, batch.metadata.slot_mapping)
    write_kv_cache(key, value, batch.kv_cache, batch.metadata.slot_mapping)
    torch.testing.assert_close(batch.kv_cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_write_matches_reference(block_size, num_kv_heads, head_dim):
    # Prompts ending before, on and after block boundaries, a chunk after a cached prefix,
    # a decode token, and two padding rows (slot -1) that must not be written.
    batch = make_paged_batch(
        [1, block_size - 1, block_size, block_size + 1, 4, 1],
        [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 3 * block_size],
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_padding_tokens=2,
    )
    _check_write(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_dtypes(dtype):
    batch = make_paged_batch(
        [3, 9], [3, 12], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype
    )
    _check_write(batch)


def test_write_casts_to_cache_dtype():
    batch = make_paged_batch(
        [5], [5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.bfloat16
    )
    _check_write(batch, key=batch.key.float(), value=batch.value.float())


def test_write_strided_key_value():
    # K and V as views into one fused [num_tokens, 2 * kv_heads, head_dim] projection output.
    batch = make_paged_batch(
        [6, 2], [6, 10], num_heads=2, num_kv_heads=2, head_dim=80, block_size=8
    )
    fused = torch.cat([batch.key, batch.value], dim=1)  # [num_tokens, 4, head_dim]
    key, value = fused[:, :2], fused[:, 2:]
    assert not key.is_contiguous()
    _check_write(batch, key=key, value=value)


def test_write_only_padding_is_a_no_op():
    batch = make_paged_batch([], [], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8,
                             num_padding_tokens=3)
    _check_write(batch)


def test_write_rejects_bad_shapes():
    key = torch.zeros(4, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 3, 8, 2, 64, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="value shape"):
        write_kv_cache(key, key[:, :1], cache, slots)
    with pytest.raises(ValueError, match="kv_cache shape"):
        write_kv_cache(key, key, cache[:, :, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping shape"):
        write_kv_cache(key, key, cache, slots[:3])
