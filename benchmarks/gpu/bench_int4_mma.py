"""The tensor-core int4 GEMV (``octavo_cuda.int4_mma``) against the Triton ``int4_gemv`` at
Llama-3-8B's projections, one to eight rows, each call after Octavo's RMS norm.

    python benchmarks/gpu/bench_int4_mma.py [--rows 1,2,4,8] [--layout panels|rows]
                                            [--write-configs TABLE]
    python benchmarks/gpu/bench_int4_mma.py --chain [--write-configs TABLE]

The tensor-core GEMV reads the words in 32-output panels, as the CUDA backend loads them
(``octavo.kernels.int4.to_panels``; ``--layout rows``: GPTQ's ``[K / 8, N]``, as with
``OCTAVO_CUDA_INT4_PANELS=0``), ``int4_gemv`` GPTQ's rows, as it gets them with
``OCTAVO_CUDA_INT4_MMA=0``. Same timing as ``bench_quant_gemv.py`` (a CUDA graph over
enough weight copies that nothing is served from L2); µs per pair (norm + kernel), the norm
alone, and the floor (the int4 words plus the float16 scales and zeros over the measured copy
bandwidth). Each config's
output is checked against the reference first. One JSON line per case, then a summary.
``--write-configs PATH`` adds each case's best config (error under 2 %) to a config table's
``int4_mma_gemv`` section (``octavo.kernels.triton.skinny_gemm``'s tables, the keys the
kernel's tuner looks up), keeping the table's other cases:

    python benchmarks/gpu/bench_int4_mma.py --rows 1,2,4,8 \
        --write-configs core/src/octavo/kernels/triton/configs/skinny_NVIDIA_H100_80GB_HBM3.json

``--chain`` times one row through 32 copies of a layer-like chain instead, each kernel
launched as in the model (PDL): fused add + RMS norm -> qkv -> RMS norm of q (the stand-in
for rotary and attention) -> o -> fused add + RMS norm -> gate_up -> SiLU-and-mul -> down. The
configs are picked where they run, after the kernels before them: a pair after a norm cannot
show how a 16-warp block that fills an SM's registers holds back the next kernel's early
blocks. It starts from the configs a model gets (``chosen_config``: the device table's) and
changes one projection's config at a time over ``CANDIDATES``, each with the next kernel
launched at the wait and after the sums (``MmaGemvConfig.early_trigger``), keeping a change
that saves more than ``--min-gain-us`` a layer, for ``--passes`` rounds. Then it times the
start and the end three times each, in turns, and the start's configs with both norms inside
the GEMVs after them (``int4_mma_gemv_add_rms_norm``: the chain without its two norm kernels).
``--write-configs`` writes the end's configs (one row) when they differ from the start's;
``--passes 0`` only times the start with and without the norms inside.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_gemv import (
    GROUP,
    SWEEP_MAX_REL_ERR,
    add_configs,
    copies_for,
    copy_bandwidth,
    rel_err,
    time_per_call,
)

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336)]


def run_case(name: str, n: int, k: int, m: int, bandwidth: float,
             layout: str = "panels") -> dict:
    from octavo.kernels.int4 import pack_rows, to_panels
    from octavo.kernels.triton.int4_gemv import int4_gemv
    from octavo.kernels.triton.rmsnorm import rms_norm
    from octavo_cuda.int4_mma import CANDIDATES, _sms, default_config, int4_mma_gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    x_in = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    q = torch.randint(0, 16, (k, n), device="cuda", generator=gen)
    qweight = pack_rows(q)
    groups = k // GROUP
    scales = torch.full((groups, n), 0.002, device="cuda", dtype=torch.float16)
    zeros = torch.full((groups, n), 8.0, device="cuda", dtype=torch.float16)

    def h():
        return rms_norm(x_in, norm_w, 1e-6)

    x = h()
    expected = x.float() @ ((q.float() - 8.0) * 0.002)
    del q
    nbytes = n * k // 2 + 2 * groups * n * 2
    ws = [qweight] + [qweight.clone() for _ in range(copies_for(nbytes) - 1)]
    mma_ws = [to_panels(w) for w in ws] if layout == "panels" else ws  # what the GEMV reads
    row = {"shape": name, "n": n, "k": k, "m": m, "layout": layout,
           "floor_us": nbytes / bandwidth * 1e6,
           "norm_us": time_per_call(lambda w: h(), ws),
           "triton_us": time_per_call(lambda w: int4_gemv(h(), w, scales, zeros, GROUP), ws),
           "triton_err": rel_err(int4_gemv(x, qweight, scales, zeros, GROUP), expected),
           "mma": []}
    for config in CANDIDATES:
        if n % (16 * config.vec):
            continue
        err = rel_err(int4_mma_gemv(x, mma_ws[0], scales, zeros, GROUP, config), expected)
        us = time_per_call(
            lambda w, c=config: int4_mma_gemv(h(), w, scales, zeros, GROUP, c), mma_ws)
        row["mma"].append([asdict(config), us, err])
    default = asdict(default_config(n, k, _sms(0)))
    row["mma_default_us"] = next(us for c, us, _ in row["mma"] if c == default)
    # what a model gets: the device table's config, else the default
    row["mma_model_us"] = time_per_call(lambda w: int4_mma_gemv(h(), w, scales, zeros, GROUP),
                                        mma_ws)
    row["mma_best"] = min((r for r in row["mma"] if r[2] < SWEEP_MAX_REL_ERR),
                          key=lambda r: r[1])
    return row


def chain_sweep(passes: int, min_gain_us: float, layers: int = 32) -> dict:
    """The ``--chain`` mode (module docstring): µs a layer for the configs a model gets, and
    for the best per-projection configs found one change at a time."""
    from octavo.kernels.int4 import to_panels
    from octavo.kernels.triton.activation import silu_and_mul
    from octavo.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm
    from octavo_cuda.int4_mma import (
        CANDIDATES,
        chosen_config,
        int4_mma_gemv,
        int4_mma_gemv_add_rms_norm,
    )

    # each launch config with the next kernel launched at the wait and after the sums
    candidates = [replace(c, early_trigger=early) for c in CANDIDATES for early in (True, False)]

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = SHAPES[1][2]  # o's K: the model's width

    def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        words = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device="cuda", generator=gen,
                              dtype=torch.int32)
        groups = k // GROUP
        scales = torch.full((groups, n), 0.02 / k**0.5, device="cuda", dtype=torch.float16)
        return to_panels(words), scales, torch.full_like(scales, 8.0)

    copies = [{name: weights(n, k) for name, n, k in SHAPES} for _ in range(layers)]
    shapes = {name: (n, k) for name, n, k in SHAPES}
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    start = {name: chosen_config(n, k, 1, torch.bfloat16, GROUP, x.device)
             for name, n, k in SHAPES}

    def layer(lw: dict, configs: dict, fused_norms: bool = False,
              x: torch.Tensor = x) -> torch.Tensor:
        def gemv(name: str, h: torch.Tensor) -> torch.Tensor:
            return int4_mma_gemv(h, *lw[name], GROUP, configs[name])

        def normed_gemv(name: str, h: torch.Tensor, residual: torch.Tensor):
            """(the GEMV of rms_norm(h + residual), h + residual)"""
            if fused_norms:
                return int4_mma_gemv_add_rms_norm(h, residual, norm_w, 1e-6, *lw[name],
                                                  GROUP, configs[name])
            h, residual = fused_add_rms_norm(h, residual, norm_w, 1e-6)
            return gemv(name, h), residual

        qkv, residual = normed_gemv("qkv", x, x)
        o = gemv("o", rms_norm(qkv[:, :hidden], norm_w, 1e-6))
        gate_up, residual = normed_gemv("gate_up", o, residual)
        return gemv("down", silu_and_mul(gate_up))

    def us_per_layer(configs: dict, fused_norms: bool = False) -> float:
        return time_per_call(lambda lw: layer(lw, configs, fused_norms), copies)

    reference = layer(copies[0], start).float()
    best, best_us, tried = dict(start), us_per_layer(start), []
    for _ in range(passes):
        for name, (n, _) in shapes.items():
            for config in candidates:
                if n % (16 * config.vec) or config == best[name]:
                    continue
                trial = {**best, name: config}
                err = rel_err(layer(copies[0], trial), reference)
                us = us_per_layer(trial)
                tried.append({"projection": name, "config": asdict(config), "us": us,
                              "rel_err": err})
                print(json.dumps({"chain": tried[-1], "best_us": best_us}), flush=True)
                if err < SWEEP_MAX_REL_ERR and us < best_us - min_gain_us:
                    best, best_us = trial, us
    # the two sets again, in turns (the sweep's figure of its winner is its luckiest timing),
    # and the start's with both norms inside the GEMVs after them (int4_mma_gemv_add_rms_norm)
    fused_err = rel_err(layer(copies[0], start, True), reference)
    again = {"start": [], "best": [], "start_fused_norms": []}
    for _ in range(3):
        for label, configs, fused in (("start", start, False), ("best", best, False),
                                      ("start_fused_norms", start, True)):
            again[label].append(us_per_layer(configs, fused))
    return {"bench": "int4_mma_chain", "layers": layers,
            "start": {name: asdict(c) for name, c in start.items()},
            "best": {name: asdict(c) for name, c in best.items()},
            **{f"{label}_us_per_layer": us for label, us in again.items()},
            "fused_norms_rel_err": fused_err, "tried": tried}


def write_chain_configs(path: str, result: dict) -> None:
    """The chain's best configs (one row) into the ``int4_mma_gemv`` section of the table."""
    from octavo.kernels.triton.skinny_gemm import tune_key
    from octavo_cuda.int4_mma import MmaGemvConfig

    add_configs(path, "int4_mma_gemv",
                "benchmarks/gpu/bench_int4_mma.py (best of each case, CUDA-graph timing over "
                "L2-cold weight copies, each call after an RMS norm; one row: --chain, each "
                "projection's config picked inside a layer-like chain)",
                {tune_key(n=n, k=k, m=1, dtype=torch.bfloat16, group=GROUP):
                 asdict(MmaGemvConfig(**result["best"][name]).as_skinny())
                 for name, n, k in SHAPES})


def write_configs(path: str, rows: list[dict]) -> None:
    """Each case's best config into the ``int4_mma_gemv`` section of the table at ``path``."""
    from octavo.kernels.skinny import m_bucket
    from octavo.kernels.triton.skinny_gemm import tune_key
    from octavo_cuda.int4_mma import MmaGemvConfig

    add_configs(path, "int4_mma_gemv",
                "benchmarks/gpu/bench_int4_mma.py (best of each case, CUDA-graph timing over "
                "L2-cold weight copies, each call after an RMS norm)",
                {tune_key(n=row["n"], k=row["k"], m=m_bucket(row["m"]), dtype=torch.bfloat16,
                          group=GROUP): asdict(MmaGemvConfig(**row["mma_best"][0]).as_skinny())
                 for row in rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1")
    parser.add_argument("--layout", choices=("panels", "rows"), default="panels",
                        help="the words the tensor-core GEMV reads: 32-output panels (what "
                        "the CUDA backend loads) or GPTQ's rows")
    parser.add_argument("--write-configs", metavar="PATH",
                        help="add each case's best config to this config table")
    parser.add_argument("--chain", action="store_true",
                        help="pick one-row configs inside a layer-like chain (module docstring)")
    parser.add_argument("--passes", type=int, default=2,
                        help="--chain: rounds over the four projections")
    parser.add_argument("--min-gain-us", type=float, default=0.2,
                        help="--chain: what a change must save a layer to be kept")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_int4_mma.py needs a CUDA GPU")
    if args.chain:
        result = chain_sweep(args.passes, args.min_gain_us)
        print(json.dumps({k: v for k, v in result.items() if k != "tried"}))
        if args.write_configs and result["best"] != result["start"]:
            write_chain_configs(args.write_configs, result)
        return
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", file=sys.stderr)
    summary, rows = [], []
    for m in (int(r) for r in args.rows.split(",")):
        for name, n, k in SHAPES:
            row = run_case(name, n, k, m, bandwidth, args.layout)
            rows.append(row)
            print(json.dumps(row), flush=True)
            best = row["mma_best"]
            summary.append(
                f"m{m} {name:8s} floor {row['floor_us']:6.1f}  norm {row['norm_us']:4.1f}  "
                f"triton {row['triton_us']:6.1f} (err {row['triton_err']:.1e})  mma default "
                f"{row['mma_default_us']:6.1f}  model {row['mma_model_us']:6.1f}  best "
                f"{best[1]:6.1f} v{best[0]['vec']} w{best[0]['warps']} (err {best[2]:.1e})")
    print("\n".join(summary))
    if args.write_configs:
        write_configs(args.write_configs, rows)


if __name__ == "__main__":
    main()
