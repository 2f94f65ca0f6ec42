"""Where W1's time goes: every engine step of the whole run, grouped by phase and batch size.

    python benchmarks/gpu/w1_timeline.py --model /tmp/qwen2.5-0.5b-random

Runs W1 (256 requests, prompts and outputs of 100-1024 tokens, seed 0, greedy, EOS ignored)
through the in-process engine (``LLM``'s engine, async scheduling as configured), after a
short untimed warm-up run, and times each ``engine.step()`` with a wall clock (no GPU
synchronisation: with async scheduling a step's time is the pipeline's pace). Each step is
filed under its number of running requests (bands of 32), or under "prefill or mixed" while
requests wait or when it schedules more tokens than running requests. Prints, per group:
steps, seconds, share of the run, ms per step and output tokens per second, then one JSON
line. W1's throughput is the total over all groups: the table says which part of the run a
change has to shorten.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def band(running: int, width: int = 32) -> str:
    low = (running - 1) // width * width + 1
    return f"decode {low}-{low + width - 1}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", default="100:1024", help="LO:HI prompt tokens (W1's)")
    parser.add_argument("--output-len", default="100:1024", help="LO:HI output tokens (W1's)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--print-steps", type=int, default=0, metavar="N",
                        help="also print the first N steps one by one")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="default: the backend's (on for CUDA)")
    args = parser.parse_args()

    from octavo import LLM, SamplingParams
    from octavo.cli.bench import make_workload
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.engine_core.gc_heap import freeze_startup_objects

    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=256, load_format=args.load_format,
              async_scheduling=args.async_scheduling)
    freeze_startup_objects()  # as octavo bench does
    engine = llm.llm_engine
    vocab = engine.config.model_config.vocab_size

    def add(workload, prefix: str) -> int:
        for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
            engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=out_len,
                                              ignore_eos=True),
                               output_kind=RequestOutputKind.FINAL_ONLY)
        return sum(workload.output_lens)

    add(make_workload(32, (16, 64), (16, 64), vocab, 1), "warm")
    while engine.has_unfinished_requests():
        engine.step()

    def span(text: str) -> tuple[int, int]:
        low, high = text.split(":")
        return int(low), int(high)

    total_out = add(make_workload(args.num_requests, span(args.input_len), span(args.output_len),
                                  vocab, 0), "")
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # steps, s, tokens
    first_steps: list[tuple[float, int, int, int]] = []
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        # The step just scheduled: a pure decode step schedules one token per running request.
        stats = engine.stats()
        decode = stats.num_waiting == 0 and stats.num_batched_tokens <= stats.num_running
        group = groups[band(stats.num_running) if decode else "prefill or mixed"]
        group[0] += 1
        group[1] += now - last
        group[2] += stats.num_running if decode else 0
        if len(first_steps) < args.print_steps:
            first_steps.append((1e3 * (now - last), stats.num_running, stats.num_waiting,
                                stats.num_batched_tokens))
        last = now
    elapsed = time.perf_counter() - start

    print(f"{args.num_requests} requests through the in-process engine: {total_out} output tokens in {elapsed:.2f} s = "
          f"{total_out / elapsed:,.0f} output tok/s")
    print(f"{'group':<30}{'steps':>7}{'s':>8}{'share':>8}{'ms/step':>9}{'tok/s':>10}")
    def order(name: str) -> tuple[bool, int]:
        return name.startswith("decode"), int(name.split()[1].split("-")[0]) \
            if name.startswith("decode") else 0

    for name in sorted(groups, key=order):
        steps, seconds, tokens = groups[name]
        print(f"{name:<30}{steps:>7}{seconds:>8.2f}{seconds / elapsed:>8.0%}"
              f"{1e3 * seconds / steps:>9.2f}{tokens / seconds if tokens else 0:>10,.0f}")
    for i, (ms, running, waiting, batched) in enumerate(first_steps):
        print(f"step {i:>3}: {ms:8.2f} ms  running {running:>3}  waiting {waiting:>3}  "
              f"scheduled tokens {batched}")
    print(json.dumps({"bench": "w1_timeline", "elapsed_s": elapsed, "output_tokens": total_out,
                      "groups": {n: {"steps": g[0], "seconds": g[1], "decode_tokens": g[2]}
                                 for n, g in groups.items()}}))


if __name__ == "__main__":
    main()
