"""Does a one-row bf16 GEMV that reads its weights before it waits for the kernel before it
(programmatic dependent launch) beat cuBLAS inside a decode-like chain? (#15, batch 1)

    python benchmarks/gpu/bench_dense_gemv.py [--shapes 0.5b,8b] [--write-configs PATH]

A GEMV alone (``bench_bf16_gemv.py``) cannot show it: the gain is the overlap with the kernel
before. So each case times a *pair*, an RMS norm (Octavo's Triton kernel, launched with PDL as
in the model) and then the GEMV of its output, over enough weight copies that L2 holds none,
from one CUDA graph (``bench_quant_gemv.time_per_call``), in microseconds per pair:

- ``norm``: the norm alone (what a pair costs beyond the GEMV);
- ``cublas``: ``F.linear``;
- ``triton``: ``dense_gemv``'s kernel, best launch config, PDL off / on with the next kernel
  launched after the K loop (``late``) / before it (``early``).

Then one layer-like chain per model shape, norm -> qkv (with bias) -> norm -> o -> norm ->
gate_up -> SiLU-and-mul -> down, over as many layer copies as the model has, with cuBLAS and
with the best Triton variant per projection: the per-layer difference is what a decode step
would gain. ``--write-configs PATH`` adds each shape's best config with its trigger
(``SkinnyConfig.early_trigger``) to a config table (``octavo.kernels.triton.skinny_gemm``),
keeping its other cases. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch
import torch.nn.functional as F
from bench_quant_gemv import (
    add_configs,
    copies_for,
    copy_bandwidth,
    time_per_call,
)

# (model, projection, N, K, has bias)
SHAPES = [("0.5b", "qkv", 1152, 896, True), ("0.5b", "o", 896, 896, False),
          ("0.5b", "gate_up", 9728, 896, False), ("0.5b", "down", 896, 4864, False),
          ("8b", "qkv", 6144, 4096, False), ("8b", "o", 4096, 4096, False),
          ("8b", "gate_up", 28672, 4096, False), ("8b", "down", 4096, 14336, False)]
LAYERS = {"0.5b": 24, "8b": 32}
VARIANTS = {"off": {"use_pdl": False}, "late": {"early_trigger": False},
            "early": {"early_trigger": True}}


def brief(config: dict) -> str:
    """A config as the summary lines print it: ``n8 k1024 s0 w4`` (+ ``runs``, + ``ls3``:
    a pipelined loop)."""
    return (f"n{config['block_n']} k{config['block_k']} s{config['split_k']} "
            f"w{config['num_warps']}" + (" runs" if config.get("sum_runs") else "")
            + (f" ls{config['load_stages']}" if config.get("load_stages", 0) > 1 else ""))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5b,8b")
    parser.add_argument("--write-configs", metavar="PATH")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dense_gemv: no CUDA device found")
    from octavo.kernels.triton import dense_gemv as dense
    from octavo.kernels.triton.activation import silu_and_mul
    from octavo.kernels.triton.rmsnorm import rms_norm

    models = args.shapes.split(",")
    bandwidth = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, best_by_shape = [], {}
    for model, proj, n, k, has_bias in SHAPES:
        if model not in models:
            continue
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        dense_w = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if has_bias \
            else None
        ws = [dense_w] + [dense_w.clone() for _ in range(copies_for(2 * n * k) - 1)]
        def norm(x=x, norm_w=norm_w):
            return rms_norm(x, norm_w, 1e-6)

        row = {"model": model, "shape": proj, "n": n, "k": k,
               "floor_us": 2 * n * k / bandwidth * 1e6,
               "norm_us": time_per_call(lambda w, norm=norm: norm(), ws),
               "cublas_us": time_per_call(lambda w, norm=norm, b=bias: F.linear(norm(), w, b),
                                          ws)}
        expected = F.linear(rms_norm(x, norm_w, 1e-6).float(), dense_w.float(),
                            None if bias is None else bias.float())
        for variant, options in VARIANTS.items():
            best = None
            for config in dense.candidate_configs():
                def pair(w, c=config, norm=norm, b=bias, options=options):
                    return dense.launch(norm(), w, b, c, **options)

                try:
                    us = time_per_call(pair, ws)
                except Exception as exc:  # noqa: BLE001
                    print(f"  skip {model} {proj} {config} {variant}: {exc}", file=sys.stderr)
                    continue
                if best is None or us < best[0]:
                    best = (us, config)
            out = dense.launch(rms_norm(x, norm_w, 1e-6), dense_w, bias, best[1], **options)
            err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            row[f"triton_{variant}_us"] = best[0]
            row[f"triton_{variant}_config"] = asdict(best[1])
            row[f"triton_{variant}_rel_err"] = err
            if variant != "off" and (best_by_shape.get((model, proj)) is None
                                     or best[0] < best_by_shape[(model, proj)][0]):
                best_by_shape[(model, proj)] = (best[0], best[1], options)
        results.append(row)
        print(f"{model:>4} {proj:>8} N{n:>6} K{k:>6} floor {row['floor_us']:5.1f} norm "
              f"{row['norm_us']:5.1f} | pair: cublas {row['cublas_us']:6.1f}  triton off "
              f"{row['triton_off_us']:6.1f} late {row['triton_late_us']:6.1f} early "
              f"{row['triton_early_us']:6.1f}  ({brief(row['triton_early_config'])} early, "
              f"{brief(row['triton_late_config'])} late)", flush=True)
        del ws, dense_w

    if args.write_configs:
        write_configs(args.write_configs, results)
    layers = []
    for model in models:
        shapes = {proj: (n, k, b) for m, proj, n, k, b in SHAPES if m == model}
        count = LAYERS[model]
        hidden = shapes["o"][1]
        weights = [{proj: (torch.randn(n, k, device="cuda", generator=gen).mul_(0.02)
                           .to(torch.bfloat16),
                           torch.randn(n, device="cuda").to(torch.bfloat16) if b else None)
                    for proj, (n, k, b) in shapes.items()} for _ in range(count)]
        x = torch.randn(1, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)

        def layer(lw, gemv, x=x, norm_w=norm_w):
            q = gemv("qkv", rms_norm(x, norm_w, 1e-6), *lw["qkv"])
            o = gemv("o", rms_norm(x, norm_w, 1e-6), *lw["o"])
            gu = gemv("gate_up", rms_norm(o, norm_w, 1e-6), *lw["gate_up"])
            return q, gemv("down", silu_and_mul(gu), *lw["down"])

        def cublas(proj, h, w, b):
            return F.linear(h, w, b)

        def triton_best(proj, h, w, b, model=model):
            _, config, options = best_by_shape[(model, proj)]
            return dense.launch(h, w, b, config, **options)

        us = {name: time_per_call(lambda lw, g=gemv: layer(lw, g), weights) for name, gemv in
              (("cublas", cublas), ("triton", triton_best))}
        ref_q, ref_d = layer(weights[0], cublas)
        got_q, got_d = layer(weights[0], triton_best)
        err = max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                  for g, r in ((got_q, ref_q), (got_d, ref_d)))
        layers.append({"model": model, "layers": count, "cublas_us_per_layer": us["cublas"],
                       "triton_us_per_layer": us["triton"], "rel_err_vs_cublas": err})
        print(f"{model} layer chain (x{count}): cublas {us['cublas']:.1f} us, triton "
              f"{us['triton']:.1f} us per layer: {(us['triton'] - us['cublas']) * count:+.0f} "
              f"us a step; rel err {err:.1e}", flush=True)
        del weights
    print(json.dumps({"bench": "dense_gemv_pdl", "copy_bandwidth_gb_per_s": bandwidth / 1e9,
                      "pairs": results, "layers": layers,
                      "best": {f"{m} {p}": {**asdict(c),
                                            "early_trigger": o.get("early_trigger", False)}
                               for (m, p), (_, c, o) in best_by_shape.items()}}))


def write_configs(path: str, results: list[dict]) -> None:
    """Add each shape's best config (its trigger with it) to the table at ``path`` under the
    key ``dense_gemv`` looks up."""
    from octavo.kernels.triton.skinny_gemm import tune_key

    entries = {}
    for r in results:
        early = r["triton_early_us"] <= r["triton_late_us"]
        config = r["triton_early_config" if early else "triton_late_config"]
        entries[tune_key(n=r["n"], k=r["k"], m=1, dtype=torch.bfloat16)] = {
            **config, "early_trigger": early}
    add_configs(path, "dense_gemv",
                "benchmarks/gpu/bench_dense_gemv.py --write-configs (best of each shape after an "
                "RMS norm, either trigger, CUDA-graph timing over L2-cold weight copies)", entries)


if __name__ == "__main__":
    main()
