"""Time the fused MoE Triton kernel against its weight-read floor on a CUDA GPU.

    python benchmarks/kernels/bench_fused_moe.py [--tokens 1,8,64,256,2048] [--sweep]

Shape: one MoE layer of Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert intermediate
768; 48 such layers per forward), bfloat16, softmax top-k routing of random router logits.

For each token count (a decode batch of that many sequences, or a prefill chunk) it prints:
the kernel's median time replayed from a CUDA graph (alignment, both grouped GEMMs and the
top-k sum: what a model step runs), the same times 48 layers (the MoE time of one model
step), the *weight-read floor* (bytes of the experts the batch touches, plus activations in
and out, over the GPU's measured copy bandwidth), the kernel's time over that floor, achieved
GB/s and TFLOP/s, and the torch per-expert path (``fused_moe_native``, host-synchronising,
called from Python) for comparison. Each output is first checked against
``fused_moe_reference`` (``rel err``). ``--sweep`` also times a grid of ``MoELaunchConfig``s per
case and prints the best (to tune ``default_moe_config``). The last line is the whole result as
one JSON object. Without CUDA it exits with a message.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NUM_LAYERS = 48  # Qwen3-30B-A3B


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), the practical memory-bound peak."""
    from triton.testing import do_bench

    src = torch.empty(num_bytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * num_bytes / (ms / 1e3)


def make_case(num_tokens: int, args, seed: int = 0):
    from octavo.model_executor.layers.fused_moe import select_experts

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = DTYPES[args.dtype]
    h, i, e = args.hidden, args.intermediate, args.num_experts

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)

    x = randn(num_tokens, h)
    w13 = randn(e, 2 * i, h, scale=h**-0.5)
    w2 = randn(e, h, i, scale=i**-0.5)
    logits = torch.randn(num_tokens, e, generator=gen, device="cuda")
    weights, ids = select_experts(logits, args.top_k, renormalize=True)
    return x, w13, w2, weights, ids


def sweep_configs():
    from octavo.kernels.triton.fused_moe import MoELaunchConfig

    for bm, bn, bk, warps, stages in itertools.product(
            (16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4)):
        yield MoELaunchConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8 if bm >= 64 else 1,
                              num_warps=warps, num_stages=stages)


def run_case(num_tokens: int, args, bandwidth: float) -> dict:
    from octavo.kernels.triton.fused_moe import default_moe_config, fused_moe
    from octavo.model_executor.layers.fused_moe import fused_moe_native, fused_moe_reference
    from triton.testing import do_bench, do_bench_cudagraph

    x, w13, w2, weights, ids = make_case(num_tokens, args)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    out = fused_moe(x, w13, w2, weights, ids).float()
    rel_err = ((out - expected).norm() / expected.norm()).item()
    graph_ms = do_bench_cudagraph(lambda: fused_moe(x, w13, w2, weights, ids), rep=200,
                                  return_mode="median")
    native_ms = None
    if not args.skip_native:
        native_ms = do_bench(lambda: fused_moe_native(x, w13, w2, weights, ids), warmup=5,
                             rep=50, return_mode="median")

    elem = x.element_size()
    experts_used = int(torch.unique(ids).numel())
    expert_bytes = 3 * args.intermediate * args.hidden * elem
    # Weights of the touched experts once; x in, the [T*k, I] activation out and back in, the
    # [T*k, H] weighted rows out and back in, the output out.
    assignments = num_tokens * args.top_k
    io_bytes = (num_tokens * args.hidden * 2 + assignments * (args.intermediate + args.hidden)
                * 2) * elem
    total_bytes = experts_used * expert_bytes + io_bytes
    floor_ms = total_bytes / bandwidth * 1e3
    flops = 2 * assignments * 3 * args.intermediate * args.hidden
    result = {
        "tokens": num_tokens,
        "experts_used": experts_used,
        "graph_ms": graph_ms,
        "step_ms": graph_ms * NUM_LAYERS,
        "floor_ms": floor_ms,
        "step_floor_ms": floor_ms * NUM_LAYERS,
        "x_floor": graph_ms / floor_ms,
        "gb_per_s": total_bytes / graph_ms / 1e6,
        "tflop_per_s": flops / graph_ms / 1e9,
        "native_ms": native_ms,
        "rel_err": rel_err,
        "config": asdict(default_moe_config(num_tokens, args.num_experts, args.top_k)),
    }
    if args.sweep:
        best = None
        for config in sweep_configs():
            try:
                ms = do_bench_cudagraph(lambda: fused_moe(x, w13, w2, weights, ids, config),
                                        rep=50, return_mode="median")
            except Exception as exc:  # out of shared memory / registers for this tile
                print(f"  skip {config}: {type(exc).__name__}", file=sys.stderr)
                continue
            if best is None or ms < best[0]:
                best = (ms, config)
        if best is not None:
            result["best_ms"], result["best_config"] = best[0], asdict(best[1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", default="1,8,32,64,128,256,512,2048",
                        help="comma-separated token counts (decode batch sizes / chunk sizes)")
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768,
                        help="each expert's intermediate size")
    parser.add_argument("--sweep", action="store_true", help="also search launch configs")
    parser.add_argument("--skip-native", action="store_true", help="do not time the torch path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_moe: no CUDA device found; this benchmark times GPU kernels (the "
                 "CPU Triton interpreter is only for tests: pytest tests/kernels)")
    bandwidth = copy_bandwidth()
    results = [run_case(int(t), args, bandwidth) for t in args.tokens.split(",")]

    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype} experts={args.num_experts} "
          f"top_k={args.top_k} hidden={args.hidden} intermediate={args.intermediate}  "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s  (x{NUM_LAYERS} layers = one step)")
    header = (f"{'tokens':>7}{'experts':>8}{'layer ms':>10}{'step ms':>9}{'floor ms':>10}"
              f"{'x floor':>8}{'GB/s':>7}{'TFLOP/s':>9}{'torch ms':>10}{'rel err':>9}"
              + ("  best ms (config)" if args.sweep else ""))
    print(header)
    print("-" * len(header))
    for r in results:
        native = "-" if r["native_ms"] is None else f"{r['native_ms']:.3f}"
        line = (f"{r['tokens']:>7}{r['experts_used']:>8}{r['graph_ms']:>10.3f}"
                f"{r['step_ms']:>9.2f}{r['floor_ms']:>10.3f}{r['x_floor']:>8.2f}"
                f"{r['gb_per_s']:>7.0f}{r['tflop_per_s']:>9.1f}{native:>10}{r['rel_err']:>9.1e}")
        if "best_ms" in r:
            c = r["best_config"]
            line += (f"  {r['best_ms']:.3f} (m{c['block_m']} n{c['block_n']} k{c['block_k']} "
                     f"w{c['num_warps']} s{c['num_stages']})")
        print(line)
    print(json.dumps({"bench": "fused_moe", "device": torch.cuda.get_device_name(),
                      "copy_bandwidth_gb_per_s": bandwidth / 1e9, "args": vars(args),
                      "results": results}))


if __name__ == "__main__":
    main()
