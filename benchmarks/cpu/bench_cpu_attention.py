"""Time the CPU backend's C++ paged attention against its torch implementation.

    python benchmarks/cpu/bench_cpu_attention.py [--dtype bf16] [--threads 2] [--isa avx2]

Both do what the CPU backend's ``CPUAttentionImpl.forward`` does (cache write + attention, what
a model layer calls), once with the C++ kernels and once with the torch fallback, on one step:
a decode batch of 32 sequences of 512 tokens, a 512-token prefill, and a few more shapes. For
each it prints the best time of both (called in turns, so that both see the same load), the
speed-up (torch time / C++ time), and the C++ kernels' bandwidth (decode: GB/s of K/V read)
or arithmetic rate (prefill: GFLOP/s of causal attention). Each output is first checked
against ``octavo.attention.reference``. The last line is the whole result as one JSON object.
Not a test: timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (name, query_lens, seq_lens)
CASES = [
    ("decode 32x512", [1] * 32, [512] * 32),
    ("prefill 1x512", [512], [512]),
    ("decode 1x4096", [1], [4096]),
    ("decode 8x2048", [1] * 8, [2048] * 8),
    ("prefill 128 after 1024", [128], [1152]),
    ("mixed 1x256 + 15 decode", [256] + [1] * 15, [256] + [1024] * 15),
]


def make_step(query_lens, seq_lens, args):
    """Random Q/K/V, a random cache with the blocks shuffled, and the step's metadata."""
    from octavo.attention.base import AttentionMetadata

    gen = torch.Generator().manual_seed(0)
    dtype, bs = DTYPES[args.dtype], args.block_size
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots, starts, used = [], [], [0], 0
    for query_len, seq_len, count in zip(query_lens, seq_lens, blocks_per_seq):
        table = perm[used:used + count]
        used += count
        tables.append(table)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + query_len)
    metadata = AttentionMetadata.from_lists(slots, starts, list(seq_lens), tables)
    num_tokens = starts[-1]
    query = torch.randn(num_tokens, args.num_heads, args.head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, generator=gen).to(dtype)
    kv_cache = torch.randn(2, num_blocks, bs, args.num_kv_heads, args.head_dim,
                           generator=gen).to(dtype)
    return query, key, value, kv_cache, metadata


def best_seconds(fns, min_time=1.0, max_rounds=100):
    """Best time of each function, called in turns (a, b, a, b, ...) for about ``min_time``
    seconds each: on a shared machine the best of many interleaved runs is the figure least
    disturbed by other load, and both sides see the same conditions."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    spent = [0.0] * len(fns)
    rounds = 0
    while rounds < 3 or (min(spent) < min_time and rounds < max_rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            best[i] = min(best[i], elapsed)
            spent[i] += elapsed
        rounds += 1
    return best


def run_case(name, query_lens, seq_lens, args, kernels):
    from octavo.attention.reference import paged_attention_reference
    from octavo_cpu.attention import CPUAttentionImpl

    query, key, value, kv_cache, meta = make_step(query_lens, seq_lens, args)
    scale = args.head_dim**-0.5
    torch_impl = CPUAttentionImpl(args.num_heads, args.num_kv_heads, args.head_dim, scale)

    def cpp_forward():  # what CPUAttentionImpl.forward does with kernels, with --isa applied
        kernels.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        return kernels.paged_attention(query, kv_cache, meta, scale, isa=args.isa)

    def torch_forward():
        return torch_impl.forward(query, key, value, kv_cache, meta)

    def rel_err(out):
        expected = paged_attention_reference(query.float(), kv_cache.float(), meta, scale)
        return float((out.float() - expected).norm() / expected.norm())

    err_cpp = rel_err(cpp_forward())
    err_torch = rel_err(torch_forward())
    t_cpp, t_torch = best_seconds([cpp_forward, torch_forward], args.min_time)

    elem = kv_cache.element_size()
    kv_bytes = sum(seq_lens) * args.num_kv_heads * args.head_dim * 2 * elem
    flops = 0  # causal: new token i of a sequence sees context + i + 1 keys; QK^T and PV
    for query_len, seq_len in zip(query_lens, seq_lens):
        context = seq_len - query_len
        keys_seen = query_len * context + query_len * (query_len + 1) // 2
        flops += 4 * keys_seen * args.num_heads * args.head_dim
    return {
        "case": name, "cpp_ms": t_cpp * 1e3, "torch_ms": t_torch * 1e3,
        "speedup": t_torch / t_cpp, "cpp_gbps": kv_bytes / t_cpp / 1e9,
        "cpp_gflops": flops / t_cpp / 1e9, "rel_err_cpp": err_cpp, "rel_err_torch": err_torch,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    parser.add_argument("--isa", default="", help="force an instruction set (avx2, avx512, ...)")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds timed per variant")
    parser.add_argument("--cases", default="", help="comma-separated case name prefixes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from octavo_cpu.kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        print("the C++ kernels are not available here (see the warning above)", file=sys.stderr)
        return 1
    isa = args.isa or kernels.isa
    print(f"dtype {args.dtype}, heads {args.num_heads}/{args.num_kv_heads}, head dim "
          f"{args.head_dim}, block size {args.block_size}, {torch.get_num_threads()} threads, "
          f"kernels {isa} (CPU runs: {', '.join(kernels.isas)})")
    header = (f"{'case':<26}{'C++ ms':>9}{'torch ms':>10}{'speed-up':>10}{'C++ GB/s':>10}"
              f"{'C++ GFLOP/s':>13}{'rel err C++':>13}")
    print(header)
    results = []
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    for name, query_lens, seq_lens in CASES:
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        r = run_case(name, query_lens, seq_lens, args, kernels)
        results.append(r)
        print(f"{r['case']:<26}{r['cpp_ms']:>9.3f}{r['torch_ms']:>10.3f}{r['speedup']:>9.2f}x"
              f"{r['cpp_gbps']:>10.1f}{r['cpp_gflops']:>13.1f}{r['rel_err_cpp']:>13.1e}")
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "isa": isa,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
