"""Would a Triton skinny kernel beat cuBLAS for bf16 weights at one row? (#15, batch 1)

    python benchmarks/gpu/bench_bf16_gemv.py

At batch 1 the bf16 projections run through ``F.linear`` (cuBLAS). For Qwen2.5-0.5B's and
Llama-3-8B's shapes this times, per call, ``F.linear`` against ``fp8_gemv``'s kernel fed bf16
weights and a scale of ones (its one-row path upcasts whatever it loads; the same loop as
the fp8 layers run) over the sweep's launch configs, and the weight-read floor, with the same
CUDA-graph method as ``bench_quant_gemv.py``. The last line is one JSON object.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from bench_quant_gemv import copies_for, copy_bandwidth, sweep_configs, time_per_call

SHAPES = [("0.5b qkv", 1152, 896), ("0.5b o", 896, 896), ("0.5b gate_up", 9728, 896),
          ("0.5b down", 896, 4864), ("8b qkv", 6144, 4096), ("8b o", 4096, 4096),
          ("8b gate_up", 28672, 4096), ("8b down", 4096, 14336)]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_bf16_gemv: no CUDA device found")
    from octavo.kernels.triton import fp8_gemv as fp8_module

    bandwidth = copy_bandwidth()
    results = []
    for name, n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).to(torch.bfloat16)
        ones = torch.ones(n, device="cuda")
        ws = [dense] + [dense.clone() for _ in range(copies_for(2 * n * k) - 1)]
        row = {"shape": name, "n": n, "k": k,
               "cublas_us": time_per_call(lambda w: F.linear(x, w), ws),
               "floor_us": 2 * n * k / bandwidth * 1e6}
        expected = F.linear(x.float(), dense.float())
        best = None
        for config in sweep_configs(1):
            try:
                us = time_per_call(lambda w, c=config: fp8_module._launch(x, w, ones, c), ws)
            except Exception as exc:  # noqa: BLE001
                print(f"  skip {name} {config}: {type(exc).__name__}", file=sys.stderr)
                continue
            if best is None or us < best[0]:
                best = (us, config)
        out = fp8_module._launch(x, dense, ones, best[1]).float()
        row["triton_best_us"] = best[0]
        row["triton_best_config"] = (best[1].block_n, best[1].block_k, best[1].num_warps)
        row["rel_err"] = ((out - expected).abs().max() / expected.abs().max()).item()
        results.append(row)
        print(f"{name:>14} N{n:>6} K{k:>6}  cublas {row['cublas_us']:6.1f}  triton "
              f"{best[0]:6.1f} {row['triton_best_config']}  floor {row['floor_us']:6.1f}  "
              f"err {row['rel_err']:.1e}", flush=True)
        del ws, dense
    print(json.dumps({"bench": "bf16_gemv", "copy_bandwidth_gb_per_s": bandwidth / 1e9,
                      "results": results}))


if __name__ == "__main__":
    main()
