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


def lm_head() -> None:
    """CPU µs per LM-head ``F.linear`` when M (sampled rows) takes a new value each call, as
    in W1's decode steps, against one M repeated and M rounded up to a multiple of 16/64."""
    results = []
    for vocab, hidden in ((49152, 896), (151936, 896), (128256, 4096)):
        w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = {m: torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) for m in range(1, 513)}
        for label, rows in (("fixed 247", [247] * 100), ("new M each call", list(range(400, 300, -1))),
                            ("new M, rounded to 16", [-(-m // 16) * 16 for m in range(300, 200, -1)]),
                            ("new M, rounded to 64", [-(-m // 64) * 64 for m in range(200, 100, -1)]),
                            ("prompt rows 1-100, new", list(range(100, 0, -1)))):
            torch.cuda.synchronize()
            start = time.thread_time()
            t0 = time.perf_counter()
            for m in rows:
                F.linear(xs[m], w)
            cpu_us = (time.thread_time() - start) / len(rows) * 1e6
            wall_us = (time.perf_counter() - t0) / len(rows) * 1e6
            torch.cuda.synchronize()
            results.append({"vocab": vocab, "hidden": hidden, "case": label, "cpu_us": cpu_us})
            print(f"lm head {vocab}x{hidden} {label:>24}: CPU {cpu_us:8.1f} us per call "
                  f"(wall {wall_us:8.1f})", flush=True)
    # The eager prompt steps' projections: a token count seen before vs a new one each call.
    for name, n, k, bias in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        for label, rows in (("8,192 repeated", [8192] * 20),
                            ("new count each call", list(range(8191, 8191 - 20 * 37, -37))),
                            ("new count, rounded to 256", [m // 256 * 256 for m in
                                                           range(7000, 7000 - 20 * 37, -37)])):
            torch.cuda.synchronize()
            start = time.thread_time()
            for m in rows:
                F.linear(x[:m], w, b)
            cpu_us = (time.thread_time() - start) / len(rows) * 1e6
            torch.cuda.synchronize()
            results.append({"shape": name, "case": label, "cpu_us": cpu_us})
            print(f"prompt-step {name:>9} N={n} K={k} {label:>26}: CPU {cpu_us:8.1f} us per call",
                  flush=True)
    print(json.dumps({"bench": "lm_head_host", "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--lm-head", action="store_true",
                        help="time the LM head's GEMM with a row count that changes every "
                             "call (as the running batch drains) against a fixed one")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear_host: no CUDA device found")
    if args.lm_head:
        lm_head()
        return
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
