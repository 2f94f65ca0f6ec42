"""Where the Triton fp8 KV-cache write and the torch reference differ on the GPU (a
diagnostic for tests/kernels/test_triton_fp8_kv_cache.py::test_fp8_cache_full_shapes_on_gpu).

    python benchmarks/gpu/diag_fp8_cache_write.py
"""

from __future__ import annotations

import torch


def main() -> None:
    from octavo.attention.reference import quantize_kv, write_kv_reference
    from octavo.kernels.triton.cache_write import write_kv_cache

    from tests.kernels.conftest import make_paged_batch

    for dtype in (torch.bfloat16, torch.float16):
        k_scale, v_scale = 0.05, 0.04
        batch = make_paged_batch([512, 1, 1], [512, 2048, 1500], num_heads=32, num_kv_heads=8,
                                 head_dim=128, block_size=16, dtype=dtype)
        dense = batch.kv_cache
        batch.kv_cache = torch.stack([quantize_kv(dense[0], k_scale),
                                      quantize_kv(dense[1], v_scale)])
        meta = batch.metadata
        expected = batch.kv_cache.clone()
        write_kv_reference(batch.key, batch.value, expected, meta.slot_mapping, k_scale, v_scale)
        write_kv_cache(batch.key, batch.value, batch.kv_cache, meta.slot_mapping,
                       k_scale=k_scale, v_scale=v_scale)
        got, want = batch.kv_cache.view(torch.uint8), expected.view(torch.uint8)
        differ = (got != want).nonzero()
        print(f"{dtype}: {len(differ)} of {got.numel()} bytes differ")
        for index in differ[:8].tolist():
            half, block, slot, head, dim = index
            token = None
            slots = meta.slot_mapping.tolist()
            flat = block * 16 + slot
            if flat in slots:
                token = slots.index(flat)
            source = (batch.key if half == 0 else batch.value)[token, head, dim] if token is not None else None
            scale = k_scale if half == 0 else v_scale
            print(f"  at {index} (token {token}): kernel {got[tuple(index)].item():#04x} "
                  f"reference {want[tuple(index)].item():#04x} input {None if source is None else float(source)} "
                  f"x/scale {None if source is None else float(source.float() * (1.0 / scale))}")


if __name__ == "__main__":
    main()
