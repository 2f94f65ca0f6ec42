"""``octavo bench throughput|latency``: measured figures plus one JSON line (``octavo bench
serve`` lives in ``octavo.cli.bench_serve``).

Throughput: a synthetic workload (random token-id prompts, lengths uniform in the given
ranges, fixed seed) run through ``LLM.generate`` (or, with ``--async-engine``, through
``AsyncLLM``: the engine core in its own process, detokenization overlapping the model's steps,
as ``octavo serve`` runs it); with ``--compare-hf``, Hugging Face
transformers ``generate`` runs the same token ids in the same process (static, left-padded
batches; only the requested output tokens are counted for it) and the ratio is printed.
Latency: one request at a time, ms per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass

from octavo.cli.options import RawDescriptionHelpFormatter, add_engine_options
from octavo.engine.arg_utils import EngineArgs
from octavo.testing.json_schemas import SCHEMA_CASES

# `octavo bench throughput --help`: plain text (the module docstring is reStructuredText).
_THROUGHPUT_DESCRIPTION = """\
Offline throughput on a synthetic workload: random token-id prompts, prompt and output lengths
uniform in the given ranges, fixed seed, greedy sampling. Runs through LLM.generate, or with
--async-engine through AsyncLLM (the engine core in its own process, as `octavo serve` runs
it). With --compare-hf, Hugging Face transformers generate then runs the same token ids in the
same process (static left-padded batches; only the requested output tokens are counted) and
the ratio is printed. Prints a summary and one JSON line.

How long: each phase shows a progress bar with its remaining time. On a CPU, HF takes about as
long as Octavo or longer (its padded batches do more work); the default workload on the
default model takes about 1.5 minutes per engine on two cores, so about 3-4 minutes with
--compare-hf (an estimate for the HF run is printed before it starts).

Example: octavo bench throughput --num-prompts 32 --input-len 64:128 --output-len 32:64 --compare-hf
"""


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def token_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (or ``N``) as an argparse type: a range of token counts."""
    low, _, high = text.partition(":")
    low_i, high_i = int(low), int(high or low)
    if low_i < 1 or high_i < low_i:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low_i, high_i


def workload_vocab_size(tokenizer, model_config) -> int:
    """The token ids random prompts are drawn from: ids both the tokenizer and the model's
    embedding know (one place, so every benchmark gets the same prompts for a seed)."""
    return min(len(tokenizer), model_config.vocab_size)


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
        help="measure throughput or latency, offline or of a running server",
        description="Benchmarks (figures, not tests). Prints a summary and one JSON line.",
    )
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    tp = modes.add_parser("throughput", help="offline throughput on a synthetic workload",
                          description=_THROUGHPUT_DESCRIPTION,
                          formatter_class=RawDescriptionHelpFormatter)
    tp.add_argument("--num-prompts", type=_positive_int, default=64, help="number of requests")
    tp.add_argument("--input-len", type=token_range, default=(64, 256), metavar="MIN:MAX",
                    help="prompt lengths, uniform in [MIN, MAX]; one number: MIN = MAX")
    tp.add_argument("--output-len", type=token_range, default=(64, 128), metavar="MIN:MAX",
                    help="output lengths, uniform in [MIN, MAX]; one number: MIN = MAX")
    tp.add_argument("--workload-seed", type=int, default=0, help="seed of the random workload")
    tp.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let EOS end requests early (default: ignore EOS so lengths are exact)")
    tp.add_argument("--async-engine", action="store_true",
                    help="run through AsyncLLM (engine core in a background process, as "
                         "`octavo serve` does) instead of LLM.generate")
    tp.add_argument("--structured", choices=("none", "json"), default="none",
                    help="json: constrain request i to JSON schema i mod 12 of "
                         "octavo.testing.json_schemas (nested objects, arrays, enums, anyOf, "
                         "...) after an untimed warm-up (one request per schema), then run the "
                         "same requests unconstrained with the same output lengths on the same "
                         "engine, each run from an empty prefix cache, and print the ratio of "
                         "output tok/s")
    tp.add_argument("--compare-hf", action="store_true",
                    help="also run HF transformers generate on the same token ids and print the ratio")
    tp.add_argument("--hf-batch-size", type=int, default=None,
                    help="static batch size for HF (default: all requests in one batch)")
    add_engine_options(tp)
    tp.set_defaults(func=run_throughput)

    lat = modes.add_parser("latency", help="single-request latency (ms per output token)",
                           description="Single-request latency: one request at a time (a fresh "
                           "random prompt each, greedy, EOS ignored), with a progress bar over "
                           "the requests. Prints a summary and one JSON line.")
    lat.add_argument("--input-len", type=_positive_int, default=128, help="prompt tokens")
    lat.add_argument("--output-len", type=_positive_int, default=128, help="output tokens")
    lat.add_argument("--num-iters", type=_positive_int, default=3, help="timed requests")
    lat.add_argument("--num-iters-warmup", type=int, default=1, help="untimed requests first")
    lat.add_argument("--compare-llama-cpp", action="store_true",
                     help="also run llama.cpp (llama-cpp-python) on the same GGUF file, one "
                          "request of each in turn, and print the decode and prompt-processing "
                          "ratios and whether the greedy tokens agree")
    lat.add_argument("--llama-cpp-threads", type=_positive_int, default=None, metavar="N",
                     help="llama.cpp's n_threads (default: --cpu-threads, else the cores this "
                          "process may use)")
    add_engine_options(lat)
    lat.set_defaults(func=run_latency)

    from octavo.cli.bench_serve import add_serve_parser

    add_serve_parser(modes)


@dataclass(slots=True)
class _OctavoRun:
    """What one Octavo throughput run measured."""

    # Wall seconds from the first request queued to the last one finished.
    elapsed_s: float
    # Output tokens generated (all completions).
    num_output_tokens: int
    # Requests preempted during the run.
    num_preemptions: int
    # Output tokens of each request, in workload order.
    output_lens: list[int]
    # Of num_preemptions, those that swapped the request's blocks to host memory.
    num_preemptions_swap: int = 0
    # Structured outputs: the steps whose sampling waited for grammar work, the engine
    # thread's seconds blocked on it, and that work's own seconds (SchedulerStats').
    grammar: tuple[int, float, float] = (0, 0.0, 0.0)
    # The engine thread's steps, its seconds scheduling, launching, waiting for results and
    # recording them, its CPU seconds and involuntary context switches (SchedulerStats'
    # engine_*, in _ENGINE_FIELDS' order).
    engine: tuple[float, ...] = (0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    # The machine's CPU seconds over the run, all CPUs together: (busy, stolen by the
    # hypervisor, in all); None where /proc/stat cannot be read.
    machine: tuple[float, float, float] | None = None


def _grammar_since(before, after) -> tuple[int, float, float]:
    """The ``structured_output_*`` counters of a run, from the stats before and after it."""
    return (after.structured_output_steps - before.structured_output_steps,
            after.structured_output_wait_s - before.structured_output_wait_s,
            after.structured_output_work_s - before.structured_output_work_s)


_ENGINE_FIELDS = ("engine_steps", "engine_schedule_s", "engine_launch_s", "engine_result_wait_s",
                  "engine_record_s", "engine_thread_cpu_s", "engine_thread_involuntary_switches")
_COUNTS = ("engine_steps", "engine_thread_involuntary_switches")


def _engine_since(before, after) -> tuple[float, ...]:
    """The ``engine_*`` counters of a run, from the stats before and after it."""
    return tuple(getattr(after, name) - getattr(before, name) for name in _ENGINE_FIELDS)


def machine_cpu_seconds(stat_path: str = "/proc/stat") -> tuple[float, float, float] | None:
    """All CPUs' seconds since boot from ``/proc/stat``'s ``cpu`` line: (busy, stolen by the
    hypervisor, in all); None where it cannot be read (not Linux)."""
    try:
        with open(stat_path) as f:
            fields = f.readline().split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    busy = user + nice + system + irq + softirq
    return busy / hz, steal / hz, (busy + idle + iowait + steal) / hz


def _machine_since(before: tuple[float, float, float] | None) -> tuple[float, float, float] | None:
    after = machine_cpu_seconds()
    if before is None or after is None:
        return None
    return tuple(b - a for a, b in zip(before, after))  # type: ignore[return-value]


def _report_engine_times(run_name: str, run: _OctavoRun, result: dict, prefix: str) -> None:
    """Print where a run's engine-thread time went and what the machine's CPUs did, and put
    them in ``result`` (``prefix`` + the ``engine_*`` names, ``machine_*``). Nothing on the
    engine for a run the counters did not see."""
    engine = run.engine
    steps = int(engine[0])
    for name, value in zip(_ENGINE_FIELDS, engine):
        result[prefix + name] = int(value) if name in _COUNTS else round(value, 4)
    if steps:
        _, schedule_s, launch_s, wait_s, record_s, cpu_s, switches = engine
        print(f"engine  : {run_name}{steps} steps; the engine thread scheduled {schedule_s:.3f} s, "
              f"launched {launch_s:.3f} s, waited for results {wait_s:.3f} s, recorded "
              f"{record_s:.3f} s ({1e3 * (schedule_s + launch_s + record_s) / steps:.3f} ms of "
              f"host work a step); it ran on a CPU {1e3 * cpu_s / steps:.3f} of the run's "
              f"{1e3 * run.elapsed_s / steps:.3f} ms a step (all its work, polling included) "
              f"and was taken off it {int(switches)} times")
    if run.machine is not None:
        busy_s, steal_s, total_s = run.machine
        result[prefix + "machine_busy_cpu_s"] = round(busy_s, 3)
        result[prefix + "machine_steal_cpu_s"] = round(steal_s, 3)
        print(f"host    : {run_name}the machine's CPUs were busy {busy_s:.1f} of {total_s:.1f} "
              f"CPU-seconds, {steal_s:.2f} s stolen by the hypervisor")


def _throughput_params(output_lens: list[int], ignore_eos: bool):
    from octavo import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=max(n, 1), ignore_eos=ignore_eos)
            for n in output_lens]


def _json_schema_params(output_lens: list[int]):
    """Request i constrained to shared schema i mod 12; EOS ends it when its JSON is complete
    (an ignored EOS would leave the grammar nothing to accept)."""
    from octavo import SamplingParams, StructuredOutputsParams

    return [SamplingParams(temperature=0.0, max_tokens=n, structured_outputs=StructuredOutputsParams(
                json=SCHEMA_CASES[i % len(SCHEMA_CASES)].schema))
            for i, n in enumerate(output_lens)]


def _warmup_workload(workload: Workload) -> Workload:
    """One one-token request per shared schema, untimed: the grammar engine's tokenizer tables
    (built once per engine, about a second) and the grammars' compilation are not what a
    steady-state throughput measures (``octavo serve`` pays them once, at the first
    constrained request, and caches each grammar)."""
    prompts = [workload.prompts[i % len(workload.prompts)] for i in range(len(SCHEMA_CASES))]
    return Workload(prompts, [1] * len(prompts))


def _check_reset(reset: bool) -> None:
    """With ``--structured``, both timed runs start from an empty prefix cache: else the
    unconstrained run would find every prompt the constrained run computed cached and skip
    its prompt steps (W1's prompt steps take 0.4-0.7 s on the H100)."""
    if not reset:
        print("warning: the prefix cache could not be emptied (a request still holds blocks); "
              "the run may find prompts cached", file=sys.stderr)


def _run_offline(llm, workload: Workload, params) -> _OctavoRun:
    before = llm.llm_engine.stats()
    machine = machine_cpu_seconds()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    elapsed = time.perf_counter() - start
    lens = [sum(len(c.token_ids) for c in o.outputs) for o in outputs]
    stats = llm.llm_engine.stats()
    return _OctavoRun(elapsed, sum(lens), stats.num_preemptions - before.num_preemptions, lens,
                      stats.num_preemptions_swap - before.num_preemptions_swap,
                      _grammar_since(before, stats), _engine_since(before, stats),
                      _machine_since(machine))


async def _run_async(engine, workload: Workload, params) -> _OctavoRun:
    from octavo.engine.output_processor import RequestOutputKind

    async def one(request_id: str, prompt: list[int], params) -> int:
        num_out = 0
        async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id,
                                            output_kind=RequestOutputKind.FINAL_ONLY):
            num_out = sum(len(c.token_ids) for c in output.outputs)
        return num_out

    from tqdm.auto import tqdm

    before = engine.scheduler_stats
    run_id = uuid.uuid4().hex[:8]  # request ids unique across runs on one engine
    bar = tqdm(total=len(workload.prompts), desc="octavo (async engine)", unit="req",
               dynamic_ncols=True)

    async def counted(request_id: str, prompt: list[int], sp) -> int:
        num_out = await one(request_id, prompt, sp)
        bar.update(1)
        return num_out

    machine = machine_cpu_seconds()
    start = time.perf_counter()
    try:
        counts = await asyncio.gather(
            *(counted(f"{run_id}-{i}", p, sp)
              for i, (p, sp) in enumerate(zip(workload.prompts, params)))
        )
    finally:
        bar.close()
    elapsed = time.perf_counter() - start
    stats = engine.scheduler_stats
    return _OctavoRun(elapsed, sum(counts), stats.num_preemptions - before.num_preemptions,
                      list(counts), stats.num_preemptions_swap - before.num_preemptions_swap,
                      _grammar_since(before, stats), _engine_since(before, stats),
                      _machine_since(machine))


def _make_workload(args: argparse.Namespace, tokenizer, model_config) -> Workload:
    vocab = workload_vocab_size(tokenizer, model_config)
    workload = make_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                             args.workload_seed)
    then = ", then the same on HF transformers (--compare-hf)" if args.compare_hf else ""
    print(f"workload: {len(workload.prompts)} requests, {workload.num_prompt_tokens:,} prompt + "
          f"{workload.num_output_tokens:,} output tokens, through Octavo{then}; progress bars "
          "show the time left", file=sys.stderr, flush=True)
    return workload


def estimate_hf_seconds(workload: Workload, batch_size: int | None, octavo_seconds: float) -> float:
    """Rough time HF ``generate`` will take, from Octavo's time on the same workload: both are
    bound by the same matrix work on a CPU (docs/benchmarks.md: 1.00x), and HF's static
    batches process every row up to the batch's longest prompt and output."""
    batch_size = batch_size or len(workload.prompts)
    hf_tokens = 0
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first:first + batch_size]
        outputs = workload.output_lens[first:first + batch_size]
        hf_tokens += len(prompts) * (max(map(len, prompts)) + max(outputs))
    octavo_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    return octavo_seconds * hf_tokens / max(octavo_tokens, 1)


def run_throughput(args: argparse.Namespace) -> int:
    if args.structured != "none" and args.compare_hf:
        print("error: --structured compares with unconstrained Octavo on the same engine; drop "
              "--compare-hf (run it separately without --structured)", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    structured = args.structured == "json"
    # With --structured json: the constrained run, then the same requests unconstrained.
    runs: list[_OctavoRun] = []
    if args.async_engine:
        from octavo.cli.serve import front_end_threads
        from octavo.engine.async_llm import AsyncLLM

        # As `octavo serve`: the model runs in the engine core's process (restored for HF).
        front_end_threads_before = front_end_threads()
        engine = AsyncLLM(engine_args)
        config = engine.config
        workload = _make_workload(args, engine.tokenizer, config.model_config)

        async def run_async() -> None:
            try:
                await engine.start()
                if structured:
                    await _run_async(engine, _warmup_workload(workload), _json_schema_params(
                        [1] * len(SCHEMA_CASES)))
                    _check_reset(await engine.reset_prefix_cache())
                    runs.append(await _run_async(engine, workload, _json_schema_params(workload.output_lens)))
                    lens = runs[0].output_lens
                    _check_reset(await engine.reset_prefix_cache())
                    runs.append(await _run_async(engine, workload, _throughput_params(lens, True)))
                else:
                    runs.append(await _run_async(engine, workload, _throughput_params(
                        workload.output_lens, args.ignore_eos)))
            finally:
                await engine.shutdown()  # frees the device before HF runs

        asyncio.run(run_async())
        import torch

        torch.set_num_threads(front_end_threads_before)
    else:
        from octavo import LLM

        llm = LLM(**asdict(engine_args))
        from octavo.engine_core.gc_heap import freeze_startup_objects

        # This process is the benchmark's: start-up's objects can leave the collector's sight.
        freeze_startup_objects()
        config = llm.llm_engine.config
        workload = _make_workload(args, llm.llm_engine.tokenizer, config.model_config)
        if structured:
            _run_offline(llm, _warmup_workload(workload), _json_schema_params([1] * len(SCHEMA_CASES)))
            _check_reset(llm.reset_prefix_cache())
            runs.append(_run_offline(llm, workload, _json_schema_params(workload.output_lens)))
            _check_reset(llm.reset_prefix_cache())
            runs.append(_run_offline(llm, workload, _throughput_params(runs[0].output_lens, True)))
        else:
            runs.append(_run_offline(llm, workload, _throughput_params(workload.output_lens,
                                                                       args.ignore_eos)))
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
    run = runs[0]
    elapsed, num_out = run.elapsed_s, run.num_output_tokens
    result = {
        "bench": "throughput",
        "backend": config.backend,
        "engine": "async" if args.async_engine else "offline",
        "async_scheduling": config.scheduler_config.async_scheduling,
        "model": config.model_config.model,
        "dtype": config.model_config.dtype_name,
        "quantization": config.model_config.quantization,
        "kv_cache_dtype": config.cache_config.cache_dtype,
        "num_requests": len(workload.prompts),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": num_out,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload.prompts) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_out + workload.num_prompt_tokens) / elapsed, 2),
        "preemptions": run.num_preemptions,
        "preemptions_swap": run.num_preemptions_swap,
        "host": platform.node(),
    }
    label = "json    " if structured else "octavo  "
    print(f"{label}: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} "
          f"output tok/s, {result['total_tokens_per_s']:.1f} total tok/s "
          f"({len(workload.prompts)} requests, {elapsed:.1f} s)")
    _report_engine_times("", run, result, "")
    if structured:
        free = runs[1]
        free_tok_s = free.num_output_tokens / free.elapsed_s
        result["structured"] = "json"
        result["unconstrained_output_tokens_per_s"] = round(free_tok_s, 2)
        result["unconstrained_elapsed_s"] = round(free.elapsed_s, 3)
        result["structured_vs_unconstrained"] = round(result["output_tokens_per_s"] / free_tok_s, 3)
        print(f"free    : {free_tok_s:.1f} output tok/s (the same requests and output lengths, "
              f"unconstrained, {free.elapsed_s:.1f} s)")
        print(f"ratio   : json / unconstrained = {result['structured_vs_unconstrained']:.2f}x")
        _report_engine_times("unconstrained run, ", free, result, "unconstrained_")
        steps, wait_s, work_s = run.grammar
        result["grammar_steps"] = steps
        result["grammar_wait_s"] = round(wait_s, 4)
        result["grammar_work_s"] = round(work_s, 4)
        if steps:
            print(f"grammar : {steps} steps sampled after grammar work; the engine thread waited "
                  f"{1e3 * wait_s / steps:.3f} ms a step ({wait_s:.2f} s in all) for "
                  f"{1e3 * work_s / steps:.3f} ms of that work")
    if args.compare_hf:
        from octavo.benchmarks.hf_baseline import run_hf_generate

        # HF runs on the same device type as the backend Octavo used (cpu, cuda, ...), now
        # that Octavo's engine (and its KV cache) is released.
        hf_device = _device_type(config.backend)
        model_config = config.model_config
        if hf_device == "cuda":
            import torch

            torch.cuda.empty_cache()
        estimate = estimate_hf_seconds(workload, args.hf_batch_size, elapsed)
        print(f"HF transformers: loading the model, then generating; expect roughly "
              f"{_duration(estimate)} (Octavo took {_duration(elapsed)}; HF pads every batch "
              "to its longest prompt and output)", file=sys.stderr, flush=True)
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

    from octavo.engine_core.gc_heap import freeze_startup_objects

    llm = LLM(**asdict(EngineArgs.from_cli_args(args)))
    freeze_startup_objects()  # this process is the benchmark's
    engine = llm.llm_engine
    vocab = workload_vocab_size(engine.tokenizer, engine.config.model_config)
    # A fresh random prompt per iteration, so no run is served from the prefix cache.
    workload = make_workload(args.num_iters_warmup + args.num_iters,
                             (args.input_len, args.input_len),
                             (args.output_len, args.output_len), vocab, 0)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llama = None
    if args.compare_llama_cpp:
        try:
            llama = _LlamaCppTurns(args, engine.config, workload)
        except Exception:
            engine.shutdown()
            raise
    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc="latency (warm-up first)", unit="req", dynamic_ncols=True)
    for prompt in prompts[: args.num_iters_warmup]:
        llm.generate(prompt, params, use_tqdm=False)
        if llama is not None:
            llama.warm_up(prompt["prompt_token_ids"])
        bar.update(1)
    latencies = []
    ttfts = []
    octavo_ids = []
    for prompt in prompts[args.num_iters_warmup :]:
        # With --compare-llama-cpp the two engines take turns, so both see the same load.
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        latencies.append(time.perf_counter() - start)
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        octavo_ids.append(list(out.outputs[0].token_ids))
        if llama is not None:
            llama.run(prompt["prompt_token_ids"])
        bar.update(1)
    bar.close()
    mean = sum(latencies) / len(latencies)
    ttft = sum(ttfts) / len(ttfts)
    per_token_ms = (mean - ttft) / max(args.output_len - 1, 1) * 1000
    result = {
        "bench": "latency",
        "backend": engine.config.backend,
        "async_scheduling": engine.config.scheduler_config.async_scheduling,
        "model": engine.config.model_config.model,
        "quantization": engine.config.model_config.quantization,
        "kv_cache_dtype": engine.config.cache_config.cache_dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "mean_latency_s": round(mean, 4),
        "mean_ttft_s": round(ttft, 4),
        "ms_per_output_token": round(per_token_ms, 3),
        "decode_tokens_per_s": round(1000 / per_token_ms, 2) if per_token_ms > 0 else None,
        "prompt_tokens_per_s": round(args.input_len / ttft, 1),
    }
    print(f"latency : {mean:.3f} s per request, TTFT {ttft * 1000:.1f} ms, "
          f"{per_token_ms:.2f} ms per output token")
    spec = engine.config.speculative_config
    if spec is not None:
        from octavo.engine.stats import spec_decode_summary

        stats = engine.stats()  # warm-up included
        result["speculative_config"] = {"method": spec.method, "k": spec.num_speculative_tokens}
        if stats.spec_decode_num_draft_tokens:
            result["draft_acceptance_rate"] = round(
                stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens, 4)
            result["mean_acceptance_length"] = round(
                1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts, 3)
        print(spec_decode_summary(stats) or "speculative decoding: no draft was verified")
    if llama is not None:
        top_k = min(20, engine.config.model_config.max_logprobs)

        def octavo_logprobs(prompt: list[int], index: int) -> dict[int, float]:
            """Octavo's top logprobs (its greedy token's included) at output position
            ``index``, reached as the timed run reached it: the same request regenerated
            with the prefix cache emptied (a cached prompt would be computed in other
            shapes, hence other roundings)."""
            probe = SamplingParams(temperature=0.0, max_tokens=index + 1, logprobs=top_k,
                                   ignore_eos=True)
            llm.reset_prefix_cache()
            out = llm.generate({"prompt_token_ids": prompt}, probe, use_tqdm=False)[0].outputs[0]
            return {t: lp.logprob for t, lp in out.logprobs[index].items()}

        result.update(llama.summary(result, workload.prompts[args.num_iters_warmup:],
                                    octavo_ids, octavo_logprobs))
    print(json.dumps(result))
    return 0


class _LlamaCppTurns:
    """llama.cpp on the latency workload's prompts, one request after each of Octavo's."""

    def __init__(self, args: argparse.Namespace, config, workload: Workload) -> None:
        import os

        from octavo.benchmarks import llama_cpp_baseline

        gguf_file = config.model_config.gguf_file
        if args.output_len < 2:
            raise ValueError("--compare-llama-cpp compares decode speed: give --output-len 2 "
                             "or more")
        if gguf_file is None:
            raise ValueError("--compare-llama-cpp needs a GGUF model (llama.cpp reads only "
                             "GGUF); pass --model FILE.gguf, or leave --model out for the "
                             "default SmolLM2 GGUF")
        threads = (args.llama_cpp_threads or config.parallel_config.cpu_threads
                   or len(os.sched_getaffinity(0)))
        self.baseline = llama_cpp_baseline
        self.output_len = args.output_len
        n_ctx = max(len(p) for p in workload.prompts) + args.output_len + 8
        # ImportError (with the install hint) when llama-cpp-python is missing.
        try:
            self.llm = llama_cpp_baseline.load_llama_cpp(gguf_file, threads, n_ctx)
        except ImportError as exc:
            raise RuntimeError(str(exc)) from None
        self.threads = threads
        self.requests = []

    def warm_up(self, prompt: list[int]) -> None:
        self.baseline.greedy_generate(self.llm, prompt, min(self.output_len, 8))

    def run(self, prompt: list[int]) -> None:
        self.requests.append(self.baseline.greedy_generate(self.llm, prompt, self.output_len))

    def summary(self, octavo: dict, prompts: list[list[int]], octavo_ids: list[list[int]],
                octavo_logprobs) -> dict:
        """Speeds and ratios; where a request's greedy tokens first differ, both engines'
        log-probabilities there (``octavo_logprobs(prompt, index)``: Octavo's top logprobs at
        output position ``index``) tell a near-tie from a real difference."""
        import llama_cpp

        run = self.baseline.LlamaCppResult(self.requests, self.threads,
                                           getattr(llama_cpp, "__version__", "?"))
        diverged = [self.baseline.first_divergence(mine, r.output_ids)
                    for mine, r in zip(octavo_ids, self.requests)]
        same = sum(d is None for d in diverged)
        explained = []
        try:
            for prompt, mine, request, index in zip(prompts, octavo_ids, self.requests,
                                                    diverged):
                if index is None or index >= min(len(mine), len(request.output_ids)):
                    continue
                explained.append(self.baseline.divergence(
                    index, mine[index], request.output_ids[index],
                    octavo_logprobs(prompt, index),
                    self.baseline.last_logprobs(self.llm, prompt, mine[:index])).as_dict())
        finally:
            self.llm.close()
        out = {
            "llama_cpp_version": run.version,
            "llama_cpp_threads": run.n_threads,
            "llama_cpp_decode_tokens_per_s": round(run.decode_tokens_per_s, 2),
            "llama_cpp_prompt_tokens_per_s": round(run.prompt_tokens_per_s, 1),
            "decode_ratio_vs_llama_cpp": round(
                octavo["decode_tokens_per_s"] / run.decode_tokens_per_s, 3),
            "prompt_ratio_vs_llama_cpp": round(
                octavo["prompt_tokens_per_s"] / run.prompt_tokens_per_s, 3),
            "greedy_identical_to_llama_cpp": f"{same}/{len(diverged)}",
            "greedy_first_divergence": diverged,
            "greedy_divergences": explained,
        }
        print(f"llama.cpp: {out['llama_cpp_decode_tokens_per_s']:.1f} decode tok/s, "
              f"{out['llama_cpp_prompt_tokens_per_s']:.0f} prompt tok/s "
              f"(llama-cpp-python {run.version}, n_threads={run.n_threads})")
        print(f"octavo   : {octavo['decode_tokens_per_s']:.1f} decode tok/s, "
              f"{octavo['prompt_tokens_per_s']:.0f} prompt tok/s")
        print(f"ratio    : decode {out['decode_ratio_vs_llama_cpp']:.2f}x, prompt "
              f"{out['prompt_ratio_vs_llama_cpp']:.2f}x; greedy tokens identical in "
              f"{out['greedy_identical_to_llama_cpp']} requests (first divergence: {diverged})")
        for d in explained:
            margin = ("(llama.cpp's token is not in Octavo's top logprobs)"
                      if d["octavo_margin"] is None else f"by {d['octavo_margin']:.3f} nats")
            print(f"divergence at token {d['index']}: Octavo picked {d['octavo_token']} over "
                  f"llama.cpp's {d['llama_cpp_token']} {margin}, llama.cpp the other way by "
                  f"{d['llama_cpp_margin']:.3f} (the engines' logprobs there differ by "
                  f"{d['disagreement']:.3f} typically): "
                  f"{'a near-tie' if d['near_tie'] else 'NOT a near-tie'}")
        return out


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _device_type(backend_name: str) -> str:
    """torch device type of the installed backend called ``backend_name``."""
    from octavo.backends.selection import list_backends
    from octavo.plugins import get_plugin_manager

    for backend in list_backends(get_plugin_manager()):
        if backend.name == backend_name:
            return backend.device_type
    raise ValueError(f"backend {backend_name!r} is not installed")
