"""Where a batch-1 decode step of the default model goes on the CPU.

Runs one request (random prompt, greedy, ``ignore_eos``) through ``LLM.generate`` and reports:

1. wall time per output token;
2. cProfile of the whole generate call, split into the model forward and the rest (engine,
   scheduler, input preparation, sampler, detokenizer);
3. ``torch.profiler`` of the same run: self CPU time per op, per decode step.

    OMP_NUM_THREADS=1 python benchmarks/cpu/profile_decode.py --cpu-threads 1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-torch-profiler", action="store_true")
    args = parser.parse_args()

    import torch
    from octavo import LLM, SamplingParams

    kwargs = {"cpu_threads": args.cpu_threads}
    if args.model:
        kwargs["model"] = args.model
    llm = LLM(**kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    rng = random.Random(0)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompt(), params, use_tqdm=False)  # warm-up

    def timed() -> tuple[float, float]:
        start = time.perf_counter()
        out = llm.generate(prompt(), params, use_tqdm=False)[0]
        total = time.perf_counter() - start
        ttft = out.metrics.first_token_time - out.metrics.arrival_time
        return total, ttft

    total, ttft = timed()
    per_token = (total - ttft) / (args.output_len - 1) * 1000
    print(f"wall: {per_token:.2f} ms per output token ({1000 / per_token:.1f} tok/s), "
          f"TTFT {ttft * 1000:.1f} ms, threads {torch.get_num_threads()}")

    profiler = cProfile.Profile()
    profiler.enable()
    total_p, ttft_p = timed()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stream = io.StringIO()
    stats.stream = stream
    stats.sort_stats("cumulative").print_stats(args.top * 2)
    print(stream.getvalue())
    stream = io.StringIO()
    stats.stream = stream
    stats.sort_stats("tottime").print_stats(args.top)
    print(stream.getvalue())

    if not args.no_torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            timed()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
