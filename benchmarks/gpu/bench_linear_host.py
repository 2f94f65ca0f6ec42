"""Host (CPU) cost of launching the prompt steps' GEMMs, per BLAS library (#15).

    python benchmarks/gpu/bench_linear_host.py [--tokens 8192]

A W1 prompt step (8,192 tokens, eager) spends more CPU launching its kernels than the GPU
spends running them (docs/benchmarks.md); under cProfile ``torch._C._nn.linear`` took ~75 µs
of CPU per call. This times, for the Qwen2.5-0.5B projections at ``--tokens`` rows (bf16),
the CPU time per ``F.linear`` call (100 calls queued without synchronising, so the GPU
never makes the host wait) and the GPU time per call (CUDA events), with torch's default
BLAS library and with each of ``cublas`` / ``cublaslt`` preferred. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [("qkv+bias", 1152, 896, True), ("o", 896, 896, False), ("gate_up", 9728, 896, False),
          ("down", 896, 4864, False)]


def measure(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, calls: int = 100):
    return measure_call(lambda: F.linear(x, w, b), calls)


def measure_call(fn, calls: int = 100):
    """(CPU µs, GPU µs) per ``fn()``: calls queued without synchronising."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start_cpu = time.thread_time()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    cpu_us = (time.thread_time() - start_cpu) / calls * 1e6
    end.synchronize()
    return cpu_us, start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear_host: no CUDA device found")
    results = []
    for library in ("default", "cublas", "cublaslt"):
        if library != "default":
            torch.backends.cuda.preferred_blas_library(library)
        for name, n, k, bias in SHAPES:
            x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
            cpu_us, gpu_us = measure(x, w, b)
            results.append({"library": library, "shape": name, "cpu_us": cpu_us,
                            "gpu_us": gpu_us})
            print(f"{library:>9} {name:>9} M={args.tokens} N={n} K={k}: CPU {cpu_us:7.1f} us "
                  f"per call, GPU {gpu_us:7.1f} us", flush=True)
    # For scale: one Triton launch of the same step (the fused add + RMS norm), same method.
    from octavo.kernels.triton.rmsnorm import fused_add_rms_norm

    x = torch.randn(args.tokens, 896, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(896, device="cuda", dtype=torch.bfloat16)
    cpu_us, gpu_us = measure_call(lambda: fused_add_rms_norm(x, x, weight, 1e-6))
    results.append({"library": "triton", "shape": "fused_add_rms_norm", "cpu_us": cpu_us,
                    "gpu_us": gpu_us})
    print(f"   triton fused_add_rms_norm M={args.tokens}: CPU {cpu_us:7.1f} us per call, "
          f"GPU {gpu_us:7.1f} us")
    print(json.dumps({"bench": "linear_host", "tokens": args.tokens, "results": results}))


if __name__ == "__main__":
    main()
