"""The decode attention kernels at W1's steady state, over launch configs (#15).

    python benchmarks/gpu/bench_decode_attention.py [--num-seqs 229] [--max-model-len 32768]

W1's steady decode step at ~229 running spends about half of its GPU time in
``_decode_partition_kernel`` (docs/benchmarks.md, "Per-step time breakdown"). This builds that
batch at the Qwen2.5-0.5B shape (14 query heads, 2 KV heads, head_dim 64, bf16 cache, blocks of
16 tokens scattered through the pool), contexts uniform in ``--context MIN:MAX`` (seed 0), and
times ``decode_attention`` per call from a CUDA graph of 20 calls, as a captured decode step
launches it (``max_seq_len`` = ``--max-model-len``), for:

- the split policy: the backend's (a batch this wide is not split), always split by
  ``partition_size``, or split into spans of ``wide_batch_span`` keys;
- then ``block_n``, ``num_warps`` and ``num_stages`` around the best split.

Each line gives µs per call and the fraction of the KV-read floor (every cached key and value
read once, at the copy bandwidth measured here); every config's output is checked against the
default's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=229)
    parser.add_argument("--context", default="200:2048", metavar="MIN:MAX")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--num-heads", type=int, default=14)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention: no CUDA device found")
    from bench_quant_gemv import copy_bandwidth, time_per_call

    from octavo.kernels.triton.decode_attention import decode_attention

    low, high = (int(v) for v in args.context.split(":"))
    gen = torch.Generator().manual_seed(0)
    seq_lens_list = torch.randint(low, high + 1, (args.num_seqs,), generator=gen).tolist()
    block = 16
    blocks_per_seq = [-(-s // block) for s in seq_lens_list]
    num_blocks = sum(blocks_per_seq) + 8
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    table = torch.zeros(args.num_seqs, width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = ids[used : used + n]
        used += n
    dev = "cuda"
    cache = torch.randn(2, num_blocks, block, args.num_kv_heads, args.head_dim,
                        generator=gen).to(torch.bfloat16).to(dev)
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim,
                        generator=gen).to(torch.bfloat16).to(dev)
    block_tables = table.to(dev)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(args.num_seqs + 1, dtype=torch.int32, device=dev)
    scale = args.head_dim ** -0.5
    kv_bytes = sum(seq_lens_list) * args.num_kv_heads * args.head_dim * 2 * 2
    bandwidth = copy_bandwidth()
    floor_us = kv_bytes / bandwidth * 1e6

    def run(**cfg) -> torch.Tensor:
        return decode_attention(query, cache, block_tables, seq_lens, query_start_loc,
                                args.max_model_len, scale, **cfg)

    def time_us(cfg: dict) -> float:
        return time_per_call(lambda _: run(**cfg), [None] * 20)

    default = dict(block_n=64, partition_size=512, unsplit_min_programs=256, num_warps=4,
                   num_stages=2)
    reference = run(**default).float()
    results = []

    def measure(cfg: dict) -> float | None:
        try:
            us = time_us(cfg)
            err = (run(**cfg).float() - reference).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
            print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            return None
        results.append({**cfg, "us": us, "max_abs_diff": err})
        print(f"{json.dumps(cfg):<110} {us:8.1f} us  {floor_us / us:5.0%} of floor  "
              f"diff {err:.1e}", flush=True)
        return us

    print(f"{args.num_seqs} sequences, contexts {low}-{high} (mean "
          f"{sum(seq_lens_list) / args.num_seqs:.0f}), {kv_bytes / 1e6:.1f} MB of K/V, floor "
          f"{floor_us:.1f} us at {bandwidth / 1e12:.2f} TB/s")
    best = (measure(default), default)
    splits = [{"unsplit_min_programs": None, "partition_size": 512},
              {"unsplit_min_programs": None, "partition_size": 1024}]
    splits += [{"wide_batch_span": span} for span in (128, 192, 256, 384, 512, 768, 1024)]
    for split in splits:
        cfg = {**default, **split}
        us = measure(cfg)
        if us is not None and us < best[0]:
            best = (us, cfg)
    split = best[1]
    for block_n, warps, stages in itertools.product([32, 64, 128], [2, 4, 8], [1, 2, 3]):
        span = split.get("wide_batch_span") or split["partition_size"]
        if block_n > span or span % block_n:
            continue
        cfg = {**split, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        if cfg == split:
            continue
        us = measure(cfg)
        if us is not None and us < best[0]:
            best = (us, cfg)
    print(f"best: {best[0]:.1f} us {best[1]} (default {results[0]['us']:.1f} us)")
    print(json.dumps({"bench": "decode_attention", "num_seqs": args.num_seqs,
                      "context": [low, high], "floor_us": floor_us, "results": results}))


if __name__ == "__main__":
    main()
