"""Time the Triton paged-attention kernels against the torch reference on a CUDA GPU.

    python benchmarks/kernels/bench_triton_attention.py [--dtype bf16] [--head-dim 128]

For each case it prints the median time of the Triton kernel called from Python (launch
overhead included) and replayed from a CUDA graph (kernels alone), the time of
``octavo.attention.reference.paged_attention_reference`` and the speed-up over it (Python
call vs Python call), and what the kernels achieved in the graph: decode is memory-bound, so
GB/s moved (K/V, query, output); prefill is compute-bound, so TFLOP/s of causal attention.
Each kernel's output is checked against the reference first (``rel err`` column). The last
line is the whole result as one JSON object. ``--set FIELD=VALUE`` overrides launch knobs.
Without CUDA it exits with a message (the CPU interpreter is for tests, not timing).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (name, query_lens, seq_lens): decode batches of growing size and context, then prefills.
DECODE_CASES = [
    ("decode b1 ctx4k", [1], [4096]),
    ("decode b8 ctx1k", [1] * 8, [1024] * 8),
    ("decode b32 ctx4k", [1] * 32, [4096] * 32),
    ("decode b64 ctx16k", [1] * 64, [16384] * 64),
    ("decode b128 ctx512", [1] * 128, [512] * 128),
]
PREFILL_CASES = [
    ("prefill 1x2048", [2048], [2048]),
    ("prefill 4x512 after 1024", [512] * 4, [1536] * 4),
    ("prefill 1x8192", [8192], [8192]),
    ("mixed 1x1024 + 31 decode", [1024] + [1] * 31, [1024] + [2048] * 31),
]


def make_step(query_lens, seq_lens, args, device="cuda"):
    """Random query, a random cache with the batch's blocks shuffled, and the step's metadata."""
    from octavo.attention.base import AttentionMetadata

    block_size = args.block_size
    dtype = DTYPES[args.dtype]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = perm[used : used + count]
        used += count
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_tokens = starts[-1]
    metadata = AttentionMetadata.from_lists(
        [0] * num_tokens, starts, list(seq_lens), block_tables, device=device  # slots unused here
    )
    # [num_tokens, num_heads, head_dim]
    query = torch.randn(num_tokens, args.num_heads, args.head_dim, dtype=dtype, device=device)
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache = torch.randn(
        2, num_blocks, block_size, args.num_kv_heads, args.head_dim, dtype=dtype, device=device
    )
    return query, kv_cache, metadata


def run_case(name, query_lens, seq_lens, args):
    from octavo.attention.reference import paged_attention_reference
    from octavo.kernels.triton import TritonLaunchConfig, decode_attention, prefill_attention
    from triton.testing import do_bench, do_bench_cudagraph

    config = TritonLaunchConfig(**args.overrides)
    query, kv_cache, meta = make_step(query_lens, seq_lens, args)
    scale = args.head_dim**-0.5
    common = (query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    if meta.is_pure_decode:
        kind = "decode"

        def triton_fn():
            return decode_attention(
                *common, meta.max_seq_len, scale,
                block_n=config.decode_block_n, partition_size=config.decode_partition_size,
                num_warps=config.decode_num_warps, num_stages=config.decode_num_stages,
            )
    else:
        kind = "prefill"

        def triton_fn():
            return prefill_attention(
                *common, meta.max_query_len, scale,
                block_m=config.prefill_block_m, block_n=config.prefill_block_n,
                num_warps=config.prefill_num_warps, num_stages=config.prefill_num_stages,
            )

    def reference_fn():
        with torch.device(query.device):  # the reference makes its mask with torch.arange
            return paged_attention_reference(query, kv_cache, meta, scale)

    out, expected = triton_fn().float(), reference_fn().float()
    rel_err = ((out - expected).norm() / expected.norm()).item()
    triton_ms = do_bench(triton_fn, warmup=25, rep=200, return_mode="median")
    # Replayed from a CUDA graph: the kernels alone, without Python launch overhead.
    graph_ms = do_bench_cudagraph(triton_fn, rep=200, return_mode="median")
    reference_ms = None
    if not args.skip_reference:
        reference_ms = do_bench(reference_fn, warmup=5, rep=50, return_mode="median")

    elem = query.element_size()
    kv_bytes = sum(seq_lens) * args.num_kv_heads * args.head_dim * 2 * elem
    io_bytes = kv_bytes + 2 * query.numel() * elem  # K/V once, query in, output out
    # Causal: token i of a sequence attends context_len + i + 1 keys; QK^T and PV, 2 flops each.
    visible = sum(
        (s - q) * q + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens)
    )
    flops = 4 * visible * args.num_heads * args.head_dim
    return {
        "case": name,
        "kind": kind,
        "triton_ms": triton_ms,
        "graph_ms": graph_ms,
        "reference_ms": reference_ms,
        "speedup": None if reference_ms is None else reference_ms / triton_ms,
        "gb_per_s": io_bytes / graph_ms / 1e6,
        "tflop_per_s": flops / graph_ms / 1e9,
        "rel_err": rel_err,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip-reference", action="store_true", help="time only the kernels")
    parser.add_argument("--only", choices=["decode", "prefill"], help="run one kind of case")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a TritonLaunchConfig field, e.g. --set prefill_block_n=32 (repeatable)",
    )
    args = parser.parse_args()
    args.overrides = {}
    for item in args.set:
        field, _, value = item.partition("=")
        args.overrides[field] = value if field == "fp32_dot_precision" else int(value)
    if not torch.cuda.is_available():
        sys.exit(
            "bench_triton_attention: no CUDA device found; this benchmark times GPU kernels "
            "(the CPU Triton interpreter is only for tests: pytest tests/kernels)"
        )
    from octavo.kernels.triton import TritonLaunchConfig

    torch.manual_seed(0)
    cases = []
    if args.only != "prefill":
        cases += DECODE_CASES
    if args.only != "decode":
        cases += PREFILL_CASES
    results = [run_case(name, q, s, args) for name, q, s in cases]

    print(
        f"{torch.cuda.get_device_name()}  dtype={args.dtype} head_dim={args.head_dim} "
        f"heads={args.num_heads}/{args.num_kv_heads} block_size={args.block_size}"
    )
    header = (
        f"{'case':<28}{'triton ms':>11}{'graph ms':>10}{'ref ms':>9}{'speedup':>9}"
        f"{'GB/s':>7}{'TFLOP/s':>9}{'rel err':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        ref = "-" if r["reference_ms"] is None else f"{r['reference_ms']:.3f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        print(
            f"{r['case']:<28}{r['triton_ms']:>11.3f}{r['graph_ms']:>10.3f}{ref:>9}{speedup:>9}"
            f"{r['gb_per_s']:>7.0f}{r['tflop_per_s']:>9.1f}{r['rel_err']:>9.1e}"
        )
    summary = {
        "bench": "triton_attention",
        "device": torch.cuda.get_device_name(),
        "args": {k: v for k, v in vars(args).items() if k not in ("only", "set")},
        "launch_config": asdict(TritonLaunchConfig(**args.overrides)),
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
