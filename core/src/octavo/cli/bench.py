"""``octavo bench throughput|latency``: measured figures plus one JSON line.

Throughput: a synthetic workload (random token-id prompts, lengths uniform in the given
ranges, fixed seed) run through ``LLM.generate``; with ``--compare-hf``, Hugging Face
transformers ``generate`` runs the same token ids in the same process (static, left-padded
batches; only the requested output tokens are counted for it) and the ratio is printed.
Latency: one request at a time, ms per output token.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict
import json
import platform
import random
import time
from dataclasses import dataclass

from octavo.engine.arg_utils import EngineArgs


@dataclass(slots=True)
class Workload:
    """A benchmark's requests."""

    # Prompt token ids per request.
    prompts: list[list[int]]
    # Requested output tokens per request.
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low_i, high_i = int(low), int(high or low)
    if low_i < 1 or high_i < low_i:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low_i, high_i


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    """Random prompts of token ids in [0, vocab_size) (deterministic for a seed)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        length = rng.randint(*input_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(length)])
        outputs.append(rng.randint(*output_len))
    return Workload(prompts, outputs)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure throughput or latency",
        description="Benchmarks (figures, not tests). Prints a summary and one JSON line.",
    )
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    tp = modes.add_parser("throughput", help="offline throughput on a synthetic workload",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    tp.add_argument("--input-len", type=_range, default=(64, 256), metavar="MIN:MAX",
                    help="prompt lengths, uniform in [MIN, MAX] (default 64:256)")
    tp.add_argument("--output-len", type=_range, default=(64, 128), metavar="MIN:MAX",
                    help="output lengths, uniform in [MIN, MAX] (default 64:128)")
    tp.add_argument("--workload-seed", type=int, default=0, help="seed of the random workload")
    tp.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let EOS end requests early (default: ignore EOS so lengths are exact)")
    tp.add_argument("--compare-hf", action="store_true",
                    help="also run HF transformers generate on the same token ids and print the ratio")
    tp.add_argument("--hf-batch-size", type=int, default=None,
                    help="static batch size for HF (default: all requests in one batch)")
    EngineArgs.add_cli_args(tp)
    tp.set_defaults(func=run_throughput)

    lat = modes.add_parser("latency", help="single-request latency (ms per output token)")
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    EngineArgs.add_cli_args(lat)
    lat.set_defaults(func=run_latency)


def run_throughput(args: argparse.Namespace) -> int:
    from octavo import LLM, SamplingParams

    llm = LLM(**asdict(EngineArgs.from_cli_args(args)))
    engine = llm.llm_engine
    vocab = min(len(engine.tokenizer), engine.config.model_config.vocab_size)
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                             args.workload_seed)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=args.ignore_eos)
              for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "bench": "throughput",
        "backend": engine.config.backend,
        "model": engine.config.model_config.model,
        "dtype": engine.config.model_config.dtype_name,
        "num_requests": len(workload.prompts),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": num_out,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload.prompts) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_out + workload.num_prompt_tokens) / elapsed, 2),
        "preemptions": engine.stats().num_preemptions,
        "host": platform.node(),
    }
    print(f"octavo  : {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} "
          f"output tok/s, {result['total_tokens_per_s']:.1f} total tok/s "
          f"({len(workload.prompts)} requests, {elapsed:.1f} s)")
    if args.compare_hf:
        from octavo.benchmarks.hf_baseline import run_hf_generate

        # HF runs on the same device type as the backend Octavo used (cpu, cuda, ...), after
        # Octavo's engine (and its KV cache) is released.
        hf_device = engine.engine_core.executor.worker.device.type
        model_config = engine.config.model_config
        engine.shutdown()
        del llm, engine
        gc.collect()
        if hf_device == "cuda":
            import torch

            torch.cuda.empty_cache()
        hf = run_hf_generate(model_config, workload, args.hf_batch_size, hf_device)
        result["hf_output_tokens_per_s"] = round(hf.output_tokens_per_s, 2)
        result["hf_elapsed_s"] = round(hf.elapsed_s, 3)
        result["hf_batch_size"] = hf.batch_size
        result["speedup_vs_hf"] = round(result["output_tokens_per_s"] / hf.output_tokens_per_s, 3)
        print(f"HF      : {hf.output_tokens_per_s:.1f} output tok/s (static batches of "
              f"{hf.batch_size}, {hf.elapsed_s:.1f} s)")
        print(f"ratio   : octavo / HF = {result['speedup_vs_hf']:.2f}x")
    print(json.dumps(result))
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from octavo import LLM, SamplingParams

    llm = LLM(**asdict(EngineArgs.from_cli_args(args)))
    engine = llm.llm_engine
    vocab = min(len(engine.tokenizer), engine.config.model_config.vocab_size)
    # A fresh random prompt per iteration, so no run is served from the prefix cache.
    workload = make_workload(args.num_iters_warmup + args.num_iters,
                             (args.input_len, args.input_len),
                             (args.output_len, args.output_len), vocab, 0)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for prompt in prompts[: args.num_iters_warmup]:
        llm.generate(prompt, params, use_tqdm=False)
    latencies = []
    ttfts = []
    for prompt in prompts[args.num_iters_warmup :]:
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        latencies.append(time.perf_counter() - start)
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    mean = sum(latencies) / len(latencies)
    ttft = sum(ttfts) / len(ttfts)
    per_token_ms = (mean - ttft) / max(args.output_len - 1, 1) * 1000
    result = {
        "bench": "latency",
        "backend": engine.config.backend,
        "model": engine.config.model_config.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "mean_latency_s": round(mean, 4),
        "mean_ttft_s": round(ttft, 4),
        "ms_per_output_token": round(per_token_ms, 3),
    }
    print(f"latency : {mean:.3f} s per request, TTFT {ttft * 1000:.1f} ms, "
          f"{per_token_ms:.2f} ms per output token")
    print(json.dumps(result))
    return 0
