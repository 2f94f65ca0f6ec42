"""Where the 64-request throughput run of the default model goes on the CPU.

Runs the workload of ``octavo bench throughput`` (random token-id prompts, lengths uniform in
the given ranges, workload seed 0, greedy, ``ignore_eos``) through ``LLM.generate`` once for
wall time, then again under ``torch.profiler`` and prints the self CPU time per op (whole run),
and per op and input shape. The first line also gives the minor page faults of the timed run.

    python benchmarks/cpu/profile_throughput.py [--num-prompts 64] [--no-torch-profiler]
"""

from __future__ import annotations

import argparse
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="64:128")
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--no-torch-profiler", action="store_true")
    args = parser.parse_args()

    from octavo import LLM, SamplingParams
    from octavo.cli.bench import make_workload

    kwargs = {}
    if args.cpu_threads:
        kwargs["cpu_threads"] = args.cpu_threads
    llm = LLM(**kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    lo_in, hi_in = (int(v) for v in args.input_len.split(":"))
    lo_out, hi_out = (int(v) for v in args.output_len.split(":"))
    workload = make_workload(args.num_prompts, (lo_in, hi_in), (lo_out, hi_out), vocab, 0)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up

    def timed() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    elapsed = timed()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"wall: {elapsed:.1f} s, {workload.num_output_tokens / elapsed:.1f} output tok/s, "
          f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens, "
          f"{faults} minor page faults")
    if args.no_torch_profiler:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        elapsed = timed()
    print(f"under the profiler: {elapsed:.1f} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
