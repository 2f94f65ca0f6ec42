"""Host CPU time of building one prompt step's inputs (``ModelRunner._prepare_inputs``).

    python benchmarks/cpu/bench_prepare_inputs.py [--num-prompts 16] [--prompt-len 512]

A real ``LLM`` on a tiny random-weight Llama (octavo.testing.tiny_models, CPU backend) gets
``--num-prompts`` prompts of ``--prompt-len`` tokens with a chunked-prefill budget that fits
them all: its first step is one prompt step of ``num_prompts * prompt_len`` tokens (8,192 by
default, W1's prompt-step size on the H100). The runner's ``_prepare_inputs`` is wrapped: on
that step it is called ``--repeats`` times more on the same ``SchedulerOutput`` (it only reads
the runner's state), each call timed with ``time.thread_time`` (the engine thread's CPU time,
so time the thread spends descheduled on a shared machine is left out). With ``--decodes N``
the step is a mixed one: N requests decode beside the prompts (their prompts of 16 tokens run
first, alone).

Prints the median and spread in µs and one JSON line. To compare two trees, run the script
with each tree first on ``PYTHONPATH``, alternating (the numbers move by a few % between runs
of one tree on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decodes", type=int, default=0,
                        help="requests in decode beside the prompts (a mixed step)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    import octavo
    from octavo.sampling_params import SamplingParams
    from octavo.testing.tiny_models import make_tiny_model

    folder = Path(tempfile.gettempdir()) / "octavo-bench-prepare-inputs-llama"
    if not (folder / "config.json").exists():
        make_tiny_model(folder, "llama", max_position_embeddings=4096)
    num_tokens = args.num_prompts * args.prompt_len + args.decodes
    llm = octavo.LLM(str(folder), dtype="float32", block_size=args.block_size,
                     max_num_batched_tokens=num_tokens,
                     max_num_seqs=args.num_prompts + args.decodes,
                     max_model_len=max(4096, args.prompt_len + 64),
                     num_gpu_blocks_override=(args.num_prompts + args.decodes)
                     * (-(-(args.prompt_len + 64) // args.block_size)),
                     enable_prefix_caching=False, async_scheduling=False)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    prepare = runner._prepare_inputs
    times: list[float] = []

    def timed(so):
        if so.total_num_scheduled_tokens == num_tokens and not times:
            for _ in range(args.repeats):
                start = time.thread_time()
                prepare(so)
                times.append(time.thread_time() - start)
        return prepare(so)

    runner._prepare_inputs = timed
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for i in range(args.decodes):
        engine.add_request(f"decode-{i}", {"prompt_token_ids": [(7 * i + j) % 370 + 3
                                                                for j in range(16)]},
                           SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    if args.decodes:
        engine.step()  # their prompts, alone
    for i in range(args.num_prompts):
        prompt = [(31 * i + 7 * j) % 370 + 3 for j in range(args.prompt_len)]
        engine.add_request(f"prompt-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests() and not times:
        engine.step()
    engine.shutdown()
    if not times:
        raise SystemExit(f"no step of {num_tokens} tokens was scheduled")
    micros = sorted(t * 1e6 for t in times)
    median = statistics.median(micros)
    print(f"_prepare_inputs, {args.num_prompts} prompts x {args.prompt_len} tokens "
          f"+ {args.decodes} decodes ({num_tokens} tokens): median {median:.0f} µs, "
          f"p10 {micros[len(micros) // 10]:.0f}, p90 {micros[9 * len(micros) // 10]:.0f} "
          f"({len(micros)} calls, thread CPU time)")
    print(json.dumps({"num_tokens": num_tokens, "median_us": round(median, 1),
                      "p10_us": round(micros[len(micros) // 10], 1),
                      "p90_us": round(micros[9 * len(micros) // 10], 1)}))


if __name__ == "__main__":
    main()
