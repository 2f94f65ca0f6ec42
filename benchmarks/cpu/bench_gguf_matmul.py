"""Time the CPU backend's GGUF matmuls against float32 ``F.linear`` on the dequantized weight.

    python benchmarks/cpu/bench_gguf_matmul.py [--threads 2] [--isa avx2] [--repeat 20]

Shapes are the default model's (SmolLM2-135M: hidden 576, intermediate 1536, vocabulary
49,152): its merged QKV (576 -> 960), gate/up (576 -> 3072), down (1536 -> 576) in Q4_1 and
the tied Q8_0 LM head (576 -> 49,152), plus the K-quants on the gate/up shape, each at 1 row
(decode), 64 rows (a decode batch) and 512 rows (prefill). For each: the best time of both
(called in turns, so both see the same load), the speed-up, and the GGUF kernel's weight
bandwidth (bytes of blocks read per call / time) and integer multiply-add rate. Each result is
checked against ``octavo_cpu.quant_reference`` first. The last line is one JSON object. Not a
test: timings depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# (name, qtype, out_features, in_features)
LAYERS = [
    ("qkv Q4_1", "Q4_1", 960, 576),
    ("gate_up Q4_1", "Q4_1", 3072, 576),
    ("down Q4_1", "Q4_1", 576, 1536),
    ("lm_head Q8_0", "Q8_0", 49152, 576),
    ("gate_up Q4_0", "Q4_0", 3072, 576),
    ("gate_up Q4_K", "Q4_K", 3072, 768),
    ("gate_up Q6_K", "Q6_K", 3072, 768),
]
ROWS = (1, 64, 512)


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--isa", default="", help="instruction set (default: the best)")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per case (best)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends/cpu/tests"))
    from octavo_cpu import quant
    from octavo_cpu import quant_reference as ref
    from test_cpu_quant import make_blocks

    if not quant.kernels_available():
        raise SystemExit("the C++ kernels are not available here")
    print(f"threads {torch.get_num_threads()}, isa {args.isa or 'best'}")
    results = []
    for name, qtype, out_features, in_features in LAYERS:
        blocks = make_blocks(qtype, out_features, in_features)
        weight = ref.dequantize(blocks, qtype, in_features)
        for rows in ROWS:
            if rows == 512 and out_features > 10000:
                continue  # the LM head only sees the last token of each prompt
            x = torch.randn(rows, in_features)
            check = quant.gguf_matmul(x[:4], blocks, qtype, in_features, isa=args.isa)
            expected = ref.gguf_matmul_reference(x[:4], blocks, qtype, in_features)
            torch.testing.assert_close(check, expected, rtol=1e-4, atol=1e-3)
            repeat = max(3, args.repeat // (1 if rows == 1 else 4))
            gguf_s = ref_s = float("inf")
            for _ in range(2):  # in turns
                gguf_s = min(gguf_s, best_time(
                    lambda: quant.gguf_matmul(x, blocks, qtype, in_features, isa=args.isa), repeat))
                ref_s = min(ref_s, best_time(lambda: torch.nn.functional.linear(x, weight), repeat))
            gb_s = blocks.numel() / gguf_s / 1e9
            gmac_s = rows * out_features * in_features / gguf_s / 1e9
            results.append({"layer": name, "rows": rows, "gguf_us": round(gguf_s * 1e6, 1),
                            "float32_us": round(ref_s * 1e6, 1),
                            "speedup": round(ref_s / gguf_s, 2),
                            "weight_gb_per_s": round(gb_s, 2), "gmac_per_s": round(gmac_s, 1)})
            print(f"{name:14s} rows {rows:4d}: gguf {gguf_s * 1e6:9.1f} us, float32 "
                  f"{ref_s * 1e6:9.1f} us, x{ref_s / gguf_s:5.2f}; weights {gb_s:6.2f} GB/s, "
                  f"{gmac_s:6.1f} GMAC/s")
    print(json.dumps({"threads": torch.get_num_threads(), "isa": args.isa or "best",
                      "results": results}))


if __name__ == "__main__":
    main()
