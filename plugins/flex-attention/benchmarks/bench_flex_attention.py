"""Time the FlexAttention kernels against the cpu backend's own and the torch reference, on CPU.

    python plugins/flex-attention/benchmarks/bench_flex_attention.py [--compile] [--head-dim 64]

For each case (a decode batch, a prefill, a chunk after a cached prefix, a mixed step) it first
checks every kernel's output against ``octavo.attention.reference`` (``max err``), then prints
the median wall time of one ``AttentionImpl.forward`` call (cache write included) for the cpu
backend (``cpu-torch``), eager FlexAttention (``cpu-flex``) and, with ``--compile``, the
``torch.compile``'d kernel (``cpu-flex-compiled``; its compilation is timed separately, as
``compile s``). The last line is the whole result as one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import ReferenceAttentionImpl

# (name, query_lens, seq_lens)
CASES = [
    ("decode b16 ctx512", [1] * 16, [512] * 16),
    ("prefill 1x512", [512], [512]),
    ("chunk 128 after 384", [128], [512]),
    ("mixed 1x256 + 15 decode", [256] + [1] * 15, [256] + [384] * 15),
]


def make_step(query_lens, seq_lens, args):
    """New q/k/v, a random cache with shuffled pages holding the cached prefixes, the metadata."""
    bs = args.block_size
    pages = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(pages))
    tables = torch.zeros((len(seq_lens), max(pages)), dtype=torch.int32)
    starts, slots, used = [0], [], 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        tables[i, : pages[i]] = perm[used : used + pages[i]]
        used += pages[i]
        starts.append(starts[-1] + q)
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(s - q, s)]
    n = starts[-1]
    metadata = AttentionMetadata.from_lists(slots, starts, list(seq_lens), tables)
    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_dim
    qkv = [torch.randn(n, heads, d) for heads in (h, kvh, kvh)]  # [num_tokens, heads, head_dim]
    kv_cache = torch.randn(2, sum(pages), bs, kvh, d)  # [2, num_blocks, block_size, kvh, dim]
    return qkv, kv_cache, metadata


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time cpu-flex-compiled")
    args = parser.parse_args()

    from octavo_cpu.attention import CPUAttentionBackend
    from octavo_flex_attention.attention import FlexAttentionBackend

    backends = [CPUAttentionBackend(), FlexAttentionBackend()]
    if args.compile:
        backends.append(FlexAttentionBackend(compiled=True))
    scale = args.head_dim**-0.5
    dims = (args.num_heads, args.num_kv_heads, args.head_dim, scale)
    results = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, query_lens, seq_lens in CASES:
            (q, k, v), cache, metadata = make_step(query_lens, seq_lens, args)
            expected = ReferenceAttentionImpl(*dims).forward(q, k, v, cache.clone(), metadata)
            row = {"case": name}
            for backend in backends:
                impl = backend.make_impl(*dims)
                start = time.perf_counter()  # the first call compiles (compiled) or traces (eager)
                out = impl.forward(q, k, v, cache.clone(), metadata)
                first_s = time.perf_counter() - start
                err = (out - expected).abs().max().item()
                call = functools.partial(impl.forward, q, k, v, cache, metadata)
                ms = median_ms(call, args.repeats)
                row[backend.name] = {"ms": round(ms, 3), "max_err": err, "first_s": round(first_s, 2)}
                print(f"{name:28s} {backend.name:18s} {ms:9.3f} ms  max err {err:.1e}  "
                      f"first call {first_s:6.2f} s", flush=True)
            results.append(row)
    print(json.dumps({"threads": torch.get_num_threads(), "args": vars(args), "cases": results}))


if __name__ == "__main__":
    main()
