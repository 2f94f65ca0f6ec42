"""The GGUF matmuls of one batch-1 decode step of the default model, alone: every weight of
SmolLM2-135M's shape (the real blocks of its GGUF file: 30 layers of Q4_1 q/k/v, o, gate,
up and down, and the tied Q8_0 LM head 576->49,152: 96.5 MB, more than the L3 cache)
multiplied by one row, in model order, as a step does (q/k/v and gate/up unmerged here). Prints the time per step, the weight bandwidth it
reaches, and the same per matmul kind. Not a test: timings depend on the machine's load.

    python benchmarks/cpu/bench_decode_matmuls.py --threads 1 [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def decode_step_weights(kernels):
    """(name, in_features, bound matmul, bytes) of every weight of the default model's GGUF
    file (the real blocks), in the order a decode step multiplies them."""
    import gguf
    from octavo.model_executor.loader.default_model import find_default_model

    reader = gguf.GGUFReader(str(find_default_model()))
    tensors = {t.name: t for t in reader.tensors}

    def bound(name: str):
        t = tensors[name]
        k = int(t.shape[0])  # GGUF shapes are [in_features, out_features]
        blocks = torch.from_numpy(t.data.copy()).reshape(int(t.shape[1]), -1)
        return k, kernels.gguf_matmul_bound(blocks, t.tensor_type.name, k), blocks.numel()

    calls = []
    for i in range(30):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):
            calls.append((part, *bound(f"blk.{i}.{part}.weight")))
    calls.append(("lm_head", *bound("token_embd.weight")))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from octavo_cpu.quant import GGUFQuantKernels

    kernels = GGUFQuantKernels()
    calls = decode_step_weights(kernels)
    total_bytes = sum(c[3] for c in calls)
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    per_kind: dict[str, float] = {}
    best = float("inf")
    for _ in range(args.steps):
        times: dict[str, float] = {}
        start = time.perf_counter()
        for name, k, matmul, _ in calls:
            t0 = time.perf_counter()
            matmul(xs[k])
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        elapsed = time.perf_counter() - start
        if elapsed < best:
            best, per_kind = elapsed, times
    print(f"threads {args.threads}: {best * 1000:.2f} ms per step, {total_bytes / 1e6:.1f} MB, "
          f"{total_bytes / best / 1e9:.2f} GB/s")
    for name, seconds in per_kind.items():
        print(f"  {name:8s} {seconds * 1000:7.2f} ms")
    print(json.dumps({"threads": args.threads, "ms_per_step": round(best * 1000, 3),
                      "gb_per_s": round(total_bytes / best / 1e9, 2),
                      **{f"{k}_ms": round(v * 1000, 3) for k, v in per_kind.items()}}))


if __name__ == "__main__":
    main()
