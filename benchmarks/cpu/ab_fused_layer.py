"""The CPU backend's fused decoder layer (``octavo_cpu.fused_layer``) on and off, in turns.

    OMP_NUM_THREADS=1 python benchmarks/cpu/ab_fused_layer.py --cpu-threads 1 --rounds 3

Loads the default model (or ``--model``) twice in one process, once with
``OCTAVO_CPU_FUSED_LAYERS=1`` and once with ``0``, and runs the same greedy request
(``--input-len`` random prompt tokens, ``--output-len`` tokens, ``ignore_eos``) through each in
turns, so both see the same load. Prints the decode time per output token of each round, the
best of each, their ratio, the load average, and whether both gave the same tokens (they must:
the fused layer calls the same ops in the same order). Not a test: timings depend on the load.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    from octavo import LLM, SamplingParams

    llms = {}
    for switch in ("1", "0"):
        os.environ["OCTAVO_CPU_FUSED_LAYERS"] = switch  # read when the worker loads the model
        kwargs = {"cpu_threads": args.cpu_threads, "kv_cache_memory_bytes": 64 * 2**20}
        if args.model:
            kwargs["model"] = args.model
        llms[switch] = LLM(**kwargs)
    vocab = llms["1"].llm_engine.config.model_config.vocab_size
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tokens = {switch: llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
              for switch, llm in llms.items()}  # warm-up
    ms: dict[str, list[float]] = {"1": [], "0": []}
    for _ in range(args.rounds):
        for switch, llm in llms.items():
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            total = time.perf_counter() - start
            ttft = out.metrics.first_token_time - out.metrics.arrival_time
            ms[switch].append((total - ttft) / (args.output_len - 1) * 1000)
    on, off = min(ms["1"]), min(ms["0"])
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"threads {args.cpu_threads}: fused on {[round(x, 2) for x in ms['1']]} ms/token, "
          f"off {[round(x, 2) for x in ms['0']]}; best {on:.2f} vs {off:.2f} ms "
          f"({off / on:.2f}x); same tokens: {tokens['1'] == tokens['0']}; load {load}")


if __name__ == "__main__":
    main()
