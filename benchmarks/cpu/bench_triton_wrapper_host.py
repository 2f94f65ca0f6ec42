"""Host CPU cost of Octavo's own Python around each Triton launch of the eager prompt step.

    python benchmarks/cpu/bench_triton_wrapper_host.py [--num-tokens 256] [--calls 2000]

Each wrapper of ``octavo.kernels.triton`` that a dense model's eager step calls (``rms_norm``,
``fused_add_rms_norm``, ``apply_rotary``, ``silu_and_mul``, ``write_kv_cache``,
``prefill_attention``, and ``TritonAttentionImpl.forward``, which calls the last two) is called
``--calls`` times on CPU tensors shaped like a Qwen2.5-0.5B prompt step (hidden 896, 14 query
heads and 2 KV heads of 64, intermediate 4864, bf16, 16 sequences), with every Triton
kernel's ``run`` replaced by a no-op: what is timed is the wrapper's Python (checks, allocations, argument
lists) and the ``kernel[grid]`` proxy, not Triton's launcher (``JITFunction.run``: argument
specialisation, cache lookup, the driver call), nor any device work. The clock is the
thread's CPU time (``time.thread_time``); each number is the median of ``--repeats`` runs, in
µs per call.

Allocations: the wrappers' cost does not depend on the token count except through their
``torch.empty``: ``--device cpu`` (the default) allocates real host buffers, cheap from the
heap at the default 256 tokens, but dear at 8,192 (glibc ``mmap``s buffers of tens of MB per
call, where the CUDA caching allocator hits its pool); ``--device meta`` allocates nothing but
runs some of torch's factory functions in Python (``empty_like``: ~20 µs), so its numbers
are not the GPU's either.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels defined as interpreted (never run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "meta"], default="cpu")
    args = parser.parse_args()

    import torch

    from octavo.attention.base import AttentionMetadata
    # The modules (``octavo.kernels.triton`` re-exports functions of the same names).
    activation, attention, cache_write, prefill_attention, rmsnorm, rotary = (
        importlib.import_module(f"octavo.kernels.triton.{name}") for name in (
            "activation", "attention", "cache_write", "prefill_attention", "rmsnorm", "rotary"))

    for kernel in (rmsnorm._rms_norm_kernel, rotary._rotary_kernel,
                   activation._silu_and_mul_kernel, cache_write._write_kv_kernel,
                   prefill_attention._prefill_kernel):
        kernel.run = lambda *a, **k: None  # the launch itself: not timed

    device = torch.device(args.device)
    dtype = torch.bfloat16
    n, hidden, heads, kv_heads, head_dim, inter = args.num_tokens, 896, 14, 2, 64, 4864
    num_seqs, block_size = 16, 16
    seq_len = n // num_seqs
    x = torch.empty(n, hidden, dtype=dtype, device=device)
    residual = torch.empty(n, hidden, dtype=dtype, device=device)
    weight = torch.empty(hidden, dtype=dtype, device=device)
    qkv = torch.empty(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim),
               v.view(n, kv_heads, head_dim))
    positions = torch.empty(n, dtype=torch.int64, device=device)
    cos_sin = torch.empty(4096, head_dim, dtype=torch.float32, device=device)
    gate_up = torch.empty(n, 2 * inter, dtype=dtype, device=device)
    num_blocks = n // block_size + 1
    kv_cache = torch.empty(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                           device=device)
    slots = torch.empty(n, dtype=torch.int64, device=device)
    block_tables = torch.empty(num_seqs, seq_len // block_size, dtype=torch.int32, device=device)
    seq_lens = torch.empty(num_seqs, dtype=torch.int32, device=device)
    query_start_loc = torch.empty(num_seqs + 1, dtype=torch.int32, device=device)
    metadata = AttentionMetadata(
        num_seqs=num_seqs, num_tokens=n, slot_mapping=slots, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables, max_query_len=seq_len,
        max_seq_len=seq_len, query_start_loc_cpu=list(range(0, n + 1, seq_len)),
        seq_lens_cpu=[seq_len] * num_seqs)
    impl = attention.TritonAttentionBackend().make_impl(heads, kv_heads, head_dim, 0.125)
    if device.type == "meta":
        # The impl refuses CPU tensors without the interpreter; meta tensors are neither.
        os.environ["TRITON_INTERPRET"] = "1"

    cases = {
        "rms_norm": lambda: rmsnorm.rms_norm(x, weight, 1e-6),
        "fused_add_rms_norm": lambda: rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6),
        "apply_rotary": lambda: rotary.apply_rotary(positions, q, k, cos_sin),
        "silu_and_mul": lambda: activation.silu_and_mul(gate_up),
        "write_kv_cache": lambda: cache_write.write_kv_cache(k, v, kv_cache, slots),
        "prefill_attention": lambda: prefill_attention.prefill_attention(
            q, kv_cache, block_tables, seq_lens, query_start_loc, seq_len, 0.125),
        "TritonAttentionImpl.forward": lambda: impl.forward(q, k, v, kv_cache, metadata),
    }
    results = {}
    for name, call in cases.items():
        for _ in range(200):
            call()
        runs = []
        for _ in range(args.repeats):
            start = time.thread_time()
            for _ in range(args.calls):
                call()
            runs.append((time.thread_time() - start) / args.calls * 1e6)
        results[name] = round(statistics.median(runs), 2)
        print(f"{name:30s} {results[name]:7.2f} µs/call (spread {min(runs):.2f}-{max(runs):.2f})")
    print(json.dumps({"device": args.device, "num_tokens": n, "us_per_call": results}))


if __name__ == "__main__":
    main()
