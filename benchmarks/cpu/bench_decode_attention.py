"""Time the CPU paged attention of a batched decode step as the engine runs it (#18).

    python benchmarks/cpu/bench_decode_attention.py [--threads 1] [--seqs 64] [--layers 8]

The default model's attention (9 query heads, 3 KV heads, head_dim 64, float32 cache, blocks of
16), one new token for each of ``--seqs`` sequences of 130-380 positions (seed 0), against
``--layers`` caches of the engine's size, visited in turn as a forward pass does: each call
reads its K/V from memory, not from a cache a previous call left warm (a microbenchmark on one
small cache would). Prints the median and best time per call over ``--rounds`` passes.
Compare builds or settings in alternating processes, e.g. ``OCTAVO_CPU_ATTENTION_HEAD_TILES=0``
(one tile per KV head) against the default (one tile per sequence for all its KV heads).
Not a test: timings depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=130)
    parser.add_argument("--max-len", type=int, default=380)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=5825, help="blocks per layer")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from octavo.attention.base import AttentionMetadata
    from octavo_cpu.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels are not available here")
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    rng = random.Random(0)
    seq_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.seqs)]
    free = list(range(1, args.cache_blocks))
    rng.shuffle(free)  # scattered blocks, as after many allocations
    tables, slots = [], []
    for n in seq_lens:
        table = [free.pop() for _ in range(-(-n // bs))]
        tables.append(table)
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
    meta = AttentionMetadata.from_lists(slots, list(range(args.seqs + 1)), seq_lens, tables)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, args.cache_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype)
              for _ in range(args.layers)]
    query = torch.randn(args.seqs, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    for cache in caches:  # warm-up (page faults of the caches' first touch)
        kernels.paged_attention(query, cache, meta, scale)
    per_call = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for cache in caches:
            kernels.paged_attention(query, cache, meta, scale)
        per_call.append((time.perf_counter() - start) / len(caches))
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * caches[0].element_size()
    result = {
        "threads": args.threads, "seqs": args.seqs, "dtype": args.dtype,
        "head_tiles": os.environ.get("OCTAVO_CPU_ATTENTION_HEAD_TILES", "1") != "0",
        "median_ms": round(statistics.median(per_call) * 1e3, 3),
        "best_ms": round(min(per_call) * 1e3, 3),
        "kv_gb_per_s_best": round(kv_bytes / min(per_call) / 1e9, 2),
        "ns_per_key_and_kv_head": round(min(per_call) * 1e9 / (sum(seq_lens) * kv_heads), 1),
        "loadavg": open("/proc/loadavg").read().split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
