"""Time the small-M quantized kernels (fp8 w8a16, int4 GPTQ) against their weight-read floors
at Llama-3-8B's layer shapes, next to bf16 and the large-M paths they replace at decode.

    python benchmarks/gpu/bench_quant_gemv.py [--rows 1,4,16] [--sweep]

For each projection shape (N, K) and row count M it prints, in microseconds per call:

- ``bf16``: ``F.linear`` with a bf16 weight (cuBLAS), and its floor (2 bytes per weight);
- ``fp8 mm``: per-token fp8 activations + ``torch._scaled_mm`` (what ``fp8_linear`` ran for
  every M before the skinny kernel); ``fp8 gemv``: ``fp8_gemv`` (tuned on first use); floor:
  1 byte per weight;
- ``int4 gemm``: the tile kernel ``int4_gemm``; ``int4 gemv``: ``int4_gemv`` (tuned);
  floor: half a byte per weight plus the float16 scales and zeros of groups of 128.

Floors are bytes over the measured device-to-device copy bandwidth. Each time is one call's
share of a CUDA graph that runs the call on enough copies of the weight (>= 256 MiB in all)
that nothing is served from L2, as in a model forward. The last rows add one decode step's
linear layers of the 8B model (32 x (qkv + o + gate_up + down)) per method: compare with
``quant-latency``'s ms per token. ``--sweep`` also times every candidate config of the
skinny kernels and prints the best per case; ``--write-configs PATH`` adds those best configs
to a config table (``octavo.kernels.triton.skinny_gemm``: the kernels read
``configs/skinny_<GPU name>.json`` instead of timing at start-up), keeping its other cases:

    python benchmarks/gpu/bench_quant_gemv.py --rows 1,2,4,8,16 --sweep \
        --write-configs core/src/octavo/kernels/triton/configs/skinny_NVIDIA_H100_80GB_HBM3.json

``--after-norm`` times every call as a *pair*: Octavo's RMS norm (Triton, launched with
programmatic dependent launch where the GPU has it, as in the model), then the kernel on its
output, so that a kernel which loads its first weights before it waits for the norm
(``octavo.kernels.triton.pdl``) is timed with the overlap it gets in a decode step; the norm
alone is printed as ``norm`` (``bench_dense_gemv.py`` times bf16 pairs so). ``quant-configs``
sweeps this way; at one row it times each fp8 config with the next kernel let launch early
(at the wait) and late (after the K loop), and the table records the faster
(``SkinnyConfig.early_trigger``).

The last line is the whole result as one JSON object. Without CUDA it exits with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

# (name, N, K): Llama-3-8B's projections (fused qkv, o, gate_up, gate alone, down).
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("gate", 14336, 4096), ("down", 4096, 14336)]
STEP_SHAPES = ("qkv", "o", "gate_up", "down")
NUM_LAYERS = 32
GROUP = 128
MIN_BYTES = 256 << 20


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    from triton.testing import do_bench

    src = torch.empty(num_bytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * num_bytes / (ms / 1e3)


def time_per_call(fn, weights: list) -> float:
    """Microseconds per ``fn(weight)`` call, from a CUDA graph over every weight copy."""
    for w in weights[:2]:
        fn(w)  # warm-up: compiles, tunes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (4 * len(weights)))
    return sorted(times)[len(times) // 2]


def copies_for(num_bytes: int) -> int:
    return max(2, -(-MIN_BYTES // num_bytes))


def run_case(name: str, n: int, k: int, m: int, args, bandwidth: float) -> dict:
    from octavo.kernels.fp8 import quantize_fp8_per_channel, quantize_fp8_per_token
    from octavo.kernels.int4 import pack_rows
    from octavo.kernels.skinny import m_bucket
    from octavo.kernels.triton import fp8_gemv as fp8_module
    from octavo.kernels.triton import int4_gemv as int4_module
    from octavo.kernels.triton.int4_gemm import int4_gemm
    from octavo.kernels.triton.rmsnorm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x_in = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    if args.after_norm:
        def h():
            return rms_norm(x_in, norm_w, 1e-6)
    else:
        def h():
            return x_in
    x = h()  # what the kernels get (for the error checks)
    dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).to(torch.bfloat16)
    fp8_w, fp8_s = quantize_fp8_per_channel(dense)
    groups = k // GROUP
    q = torch.randint(0, 16, (k, n), device="cuda", generator=gen)
    qweight = pack_rows(q)
    scales = torch.full((groups, n), 0.002, device="cuda", dtype=torch.float16)
    zeros = torch.full((groups, n), 8.0, device="cuda", dtype=torch.float16)

    bf16_bytes, fp8_bytes = 2 * n * k, n * k
    int4_bytes = n * k // 2 + 2 * groups * n * 2
    bf16_ws = [dense] + [dense.clone() for _ in range(copies_for(bf16_bytes) - 1)]
    del dense
    fp8_ws = [fp8_w] + [fp8_w.clone() for _ in range(copies_for(fp8_bytes) - 1)]
    int4_ws = [qweight] + [qweight.clone() for _ in range(copies_for(int4_bytes) - 1)]

    def scaled_mm(w):
        x_fp8, x_scale = quantize_fp8_per_token(h())
        return torch._scaled_mm(x_fp8, w.t(), scale_a=x_scale, scale_b=fp8_s.reshape(1, -1),
                                out_dtype=torch.bfloat16)

    result = {
        "shape": name, "n": n, "k": k, "m": m, "after_norm": args.after_norm,
        "norm_us": time_per_call(lambda w: h(), bf16_ws) if args.after_norm else 0.0,
        "bf16_us": time_per_call(lambda w: F.linear(h(), w), bf16_ws),
        "bf16_floor_us": bf16_bytes / bandwidth * 1e6,
        "fp8_mm_us": time_per_call(scaled_mm, fp8_ws),
        "fp8_gemv_us": time_per_call(lambda w: fp8_module.fp8_gemv(h(), w, fp8_s), fp8_ws),
        "fp8_floor_us": fp8_bytes / bandwidth * 1e6,
        "int4_gemm_us": time_per_call(lambda w: int4_gemm(h(), w, scales, zeros, GROUP),
                                      int4_ws),
        "int4_gemv_us": time_per_call(
            lambda w: int4_module.int4_gemv(h(), w, scales, zeros, GROUP), int4_ws),
        "int4_floor_us": int4_bytes / bandwidth * 1e6,
    }
    expected = {"fp8": x.float() @ (fp8_w.float() * fp8_s[:, None]).t(),
                "int4": x.float() @ ((q.float() - 8.0) * scales[0, 0].float())}
    result["fp8_rel_err"] = rel_err(fp8_module.fp8_gemv(x, fp8_w, fp8_s), expected["fp8"])
    result["int4_rel_err"] = rel_err(int4_module.int4_gemv(x, qweight, scales, zeros, GROUP),
                                     expected["int4"])
    del q
    if args.sweep:
        for label, module, ws, call in (
                ("fp8", fp8_module, fp8_ws,
                 lambda w, c: fp8_module.fp8_gemv(h(), w, fp8_s, c)),
                ("int4", int4_module, int4_ws,
                 lambda w, c: int4_module.int4_gemv(h(), w, scales, zeros, GROUP, None, c))):
            if label not in args.sweep_kernels.split(","):
                continue
            best = None
            # the grid, then the kernel's own tuner candidates not in it (int4: split_k=16)
            grid = [] if args.candidates_only else list(sweep_configs(m, label))
            configs = [*grid, *module.candidate_configs(m_bucket(m))]
            if label == "fp8" and m == 1 and args.after_norm:
                # under PDL the next kernel may launch at the wait or after the K loop:
                # which is faster depends on the shape (as for dense_gemv)
                configs += [replace(c, early_trigger=False) for c in configs]
            for config in dict.fromkeys(configs):
                try:
                    us = time_per_call(lambda w, c=config, f=call: f(w, c), ws)
                except Exception as exc:  # noqa: BLE001  (a tile too big for this GPU)
                    print(f"  skip {label} {config}: {type(exc).__name__}", file=sys.stderr)
                    continue
                # a config goes into a table only if its output is right (the sweep runs
                # configs that no test may have run on this GPU)
                err = rel_err(call(ws[0], config), expected[label])
                result.setdefault(f"{label}_swept", []).append([asdict(config), us, err])
                if err > SWEEP_MAX_REL_ERR:
                    print(f"  WRONG {label} {config}: relative error {err:.3g}", file=sys.stderr)
                    continue
                if best is None or us < best[0]:
                    best = (us, config)
            if best is not None:
                result[f"{label}_best_us"], result[f"{label}_best_config"] = \
                    best[0], asdict(best[1])
    return result


# Largest error (of the largest output) a swept config may give to be chosen: the kernels'
# float32 sums of bf16 inputs give ~3e-3 here (bf16 output rounding)
SWEEP_MAX_REL_ERR = 2e-2


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).abs().max() / expected.abs().max()).item()


def sweep_configs(m: int, kernel: str = "int4"):
    """About 35 configs: output blocks x input steps x warps, split-K chosen from the shape;
    for fp8 at one row also tiles of 16-64 Ki weights with their products summed over 16-input
    runs first (``SkinnyConfig.sum_runs``: the per-lane sums would not fit in registers)."""
    from octavo.kernels.triton.skinny_gemm import SkinnyConfig

    for block_n in (16, 32, 64, 128, 256):
        for block_k in (64, 128, 256, 512):
            for warps in (4, 8):
                if block_n * block_k <= 32 * 1024:  # registers of the per-lane accumulator
                    yield SkinnyConfig(block_n, block_k, 0, warps)
    if kernel == "fp8" and m == 1:
        for block_n in (8, 16, 32, 64):
            for block_k in (1024, 2048):
                for warps in (4, 8):
                    # the tile in registers: at most 256 bytes a thread (spills beyond)
                    if 16 * 1024 <= block_n * block_k <= warps * 8 * 1024:
                        yield SkinnyConfig(block_n, block_k, 0, warps, sum_runs=True)


def load_table(path: str) -> dict:
    """The config table at ``path``, or a new one for this GPU; with this GPU's chip (what lets
    a GPU of the same chip without a table of its own use it)."""
    from pathlib import Path

    from octavo.kernels.triton.skinny_gemm import chip_of

    table_path = Path(path)
    table = (json.loads(table_path.read_text()) if table_path.is_file()
             else {"device": torch.cuda.get_device_name(), "kernels": {}})
    table["chip"] = chip_of(torch.cuda.get_device_properties())
    return table


def save_table(path: str, table: dict) -> None:
    """Write ``table`` to ``path``, each kernel's cases sorted."""
    from pathlib import Path

    for kernel, entries in table["kernels"].items():
        table["kernels"][kernel] = dict(sorted(entries.items()))
    table_path = Path(path)
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"config table: {table_path} "
          f"({sum(len(e) for e in table['kernels'].values())} cases)", flush=True)


def written_by_kernel(table: dict) -> dict[str, str]:
    """The table's ``"written_by"``, by kernel (an older table's one string is the fp8 and
    int4 sweep's)."""
    written_by = table.get("written_by", {})
    if isinstance(written_by, str):
        written_by = {kernel: written_by for kernel in table["kernels"]}
    table["written_by"] = written_by
    return written_by


def add_configs(path: str, kernel: str, written_by: str, entries: dict[str, dict]) -> None:
    """Add ``entries`` (``tune_key`` -> config fields) to ``kernel``'s section of the table at
    ``path``, noting how they were found, and write it back."""
    table = load_table(path)
    written_by_kernel(table)[kernel] = written_by
    table["kernels"].setdefault(kernel, {}).update(entries)
    save_table(path, table)


def write_configs(path: str, results: list[dict], after_norm: bool,
                  candidates_only: bool = False) -> None:
    """Add each case's best swept config to the table at ``path`` under the key the kernels
    look up (``tune_key``: bf16 activations; int4 with groups of ``GROUP``, natural order)."""
    from octavo.kernels.skinny import m_bucket
    from octavo.kernels.triton.skinny_gemm import tune_key

    how = ("benchmarks/gpu/bench_quant_gemv.py --sweep (best of each case, CUDA-graph timing "
           "over L2-cold weight copies" + (", each call after an RMS norm" if after_norm
                                          else "")
           + (", the tuner's candidates only)" if candidates_only else ")"))
    found: dict[str, dict[str, dict]] = {"fp8_gemv": {}, "int4_gemv": {}}
    for r in results:
        key = tune_key(n=r["n"], k=r["k"], m=m_bucket(r["m"]), dtype=torch.bfloat16)
        if "fp8_best_config" in r:
            found["fp8_gemv"][key] = r["fp8_best_config"]
        if "int4_best_config" in r:
            int4_key = key + "," + tune_key(group=GROUP, act_order=False)
            found["int4_gemv"][int4_key] = r["int4_best_config"]
    for kernel, entries in found.items():
        if entries:  # swept now (--sweep-kernels)
            add_configs(path, kernel, how, entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="comma-separated row counts M")
    parser.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES),
                        help="comma-separated projections to time (default: all)")
    parser.add_argument("--sweep", action="store_true",
                        help="also search the skinny kernels' launch configs")
    parser.add_argument("--sweep-kernels", default="fp8,int4",
                        help="with --sweep: which skinny kernels to search (fp8, int4)")
    parser.add_argument("--candidates-only", action="store_true",
                        help="with --sweep: only the kernels' tuner candidates, not the grid")
    parser.add_argument("--after-norm", action="store_true",
                        help="time each call after an RMS norm, as a pair (see above)")
    parser.add_argument("--write-configs", metavar="PATH",
                        help="with --sweep: add the best configs to this config table (JSON)")
    args = parser.parse_args()
    if args.write_configs and not args.sweep:
        parser.error("--write-configs needs --sweep (it writes what the sweep found)")
    if not torch.cuda.is_available():
        sys.exit("bench_quant_gemv: no CUDA device found; this benchmark times GPU kernels "
                 "(the CPU Triton interpreter is only for tests: pytest tests/kernels)")
    bandwidth = copy_bandwidth()
    rows = [int(m) for m in args.rows.split(",")]
    names = args.shapes.split(",")
    unknown = set(names) - {name for name, _, _ in SHAPES}
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}; known: "
                     f"{', '.join(name for name, _, _ in SHAPES)}")
    results = [run_case(name, n, k, m, args, bandwidth)
               for m in rows for name, n, k in SHAPES if name in names]
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e9:.0f} GB/s  "
          "(us per call; floor = bytes / copy bandwidth)")
    cols = ["norm", "bf16", "bf16_floor", "fp8_mm", "fp8_gemv", "fp8_floor", "int4_gemm",
            "int4_gemv", "int4_floor"]
    header = f"{'shape':>8}{'N':>7}{'K':>7}{'M':>4}" + "".join(f"{c:>12}" for c in cols)
    print(header)
    print("-" * len(header))
    for r in results:
        line = f"{r['shape']:>8}{r['n']:>7}{r['k']:>7}{r['m']:>4}" + "".join(
            f"{r[c + '_us']:>12.1f}" for c in cols)
        for label in ("fp8", "int4"):
            if f"{label}_best_us" in r:
                c = r[f"{label}_best_config"]
                trigger = "" if c.get("early_trigger", True) else " late"
                runs = " runs" if c.get("sum_runs") else ""
                staged = f" ls{c['load_stages']}" if c.get("load_stages", 0) > 1 else ""
                line += (f"  {label} best {r[f'{label}_best_us']:.1f} (n{c['block_n']} "
                         f"k{c['block_k']} s{c['split_k']} w{c['num_warps']}{trigger}{runs}"
                         f"{staged})")
        print(line)
    print(f"\none decode step's linear layers ({NUM_LAYERS} x {' + '.join(STEP_SHAPES)}), ms:")
    for m in rows:
        step = {c: NUM_LAYERS * sum(r[c + "_us"] for r in results
                                    if r["m"] == m and r["shape"] in STEP_SHAPES) / 1e3
                for c in cols}
        print(f"  M={m:<3}" + "  ".join(f"{c} {v:.2f}" for c, v in step.items()))
    if args.write_configs:
        write_configs(args.write_configs, results, args.after_norm, args.candidates_only)
    print(json.dumps({"bench": "quant_gemv", "device": torch.cuda.get_device_name(),
                      "copy_bandwidth_gb_per_s": bandwidth / 1e9, "results": results}))


if __name__ == "__main__":
    main()
