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

``--async-engine`` runs the same requests through ``AsyncLLM`` (the engine core in its own
process, as ``octavo bench throughput --async-engine`` and ``octavo serve`` do) and times the
gaps between the per-step messages the front end receives (each carries the step's scheduler
snapshot, so the grouping is the same); it also prints both processes' CPU time per step.
``--no-warmup`` skips the warm-up run, as ``octavo bench throughput`` does (no warm-up): the
first-call costs of a fresh process then land in the timed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict


def band(running: int, width: int = 32) -> str:
    low = (running - 1) // width * width + 1
    return f"decode {low}-{low + width - 1}"


class Timeline:
    """Step times filed by group, fed one ``(now, stats)`` per engine step."""

    def __init__(self, start: float, print_steps: int) -> None:
        self.last = start
        self.print_steps = print_steps
        self.groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # steps, s, tokens
        self.first_steps: list[tuple[float, int, int, int]] = []

    def record(self, now: float, stats) -> None:
        # The step just scheduled: a pure decode step schedules one token per running request.
        decode = stats.num_waiting == 0 and stats.num_batched_tokens <= stats.num_running
        group = self.groups[band(stats.num_running) if decode else "prefill or mixed"]
        group[0] += 1
        group[1] += now - self.last
        group[2] += stats.num_running if decode else 0
        if len(self.first_steps) < self.print_steps:
            self.first_steps.append((1e3 * (now - self.last), stats.num_running,
                                     stats.num_waiting, stats.num_batched_tokens))
        self.last = now

    @property
    def num_steps(self) -> int:
        return sum(int(g[0]) for g in self.groups.values())


class CompileLog:
    """Every Triton kernel variant this process JIT-compiles (or loads from Triton's disk
    cache: both go through the same path), through Triton's post-compile hook."""

    def __init__(self) -> None:
        from triton import knobs

        self.events: list[tuple[float, str]] = []
        self.timed_start = float("inf")
        knobs.runtime.jit_post_compile_hook = self._hook

    def _hook(self, *, repr: str, key, **_) -> None:
        # The name and launch options, then the specialization key (each argument's type and
        # what Triton specialized on: "D" = divisible by 16, 1 = the value one).
        self.events.append((time.perf_counter(), f"{repr.split('(')[0]} {key}"))

    def mark(self, start: float) -> None:
        self.timed_start = start

    def report(self) -> None:
        before = sum(t < self.timed_start for t, _ in self.events)
        during = [(t, r) for t, r in self.events if t >= self.timed_start]
        print(f"Triton kernel variants: {before} before the timed run, {len(during)} during it")
        for t, r in self.events:
            print(f"  {t - self.timed_start:+8.3f} s  {r[:1500]}")


def override_launch_config(items: list[str]) -> None:
    """Make the CUDA backend build its attention with these TritonLaunchConfig fields."""
    import functools

    import octavo_cuda.attention as cuda_attention

    fields = {}
    for item in items:
        name, value = item.split("=", 1)
        fields[name] = None if value.lower() == "none" else int(value)
    cuda_attention.TritonLaunchConfig = functools.partial(cuda_attention.TritonLaunchConfig,
                                                          **fields)
    print(f"TritonLaunchConfig overrides: {fields}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    from octavo.cli.bench import token_range

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=token_range, default=(100, 1024), metavar="MIN:MAX",
                        help="prompt tokens (default W1's)")
    parser.add_argument("--output-len", type=token_range, default=(100, 1024),
                        metavar="MIN:MAX", help="output tokens (default W1's)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--print-steps", type=int, default=0, metavar="N",
                        help="also print the first N steps one by one")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="default: the backend's (on for CUDA)")
    parser.add_argument("--async-engine", action="store_true",
                        help="through AsyncLLM (engine core in its own process) instead")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="an untimed warm-up run of 32 short requests first (default on)")
    parser.add_argument("--list-compiles", action="store_true",
                        help="in-process only: list the Triton kernels this process compiled "
                             "(or loaded from Triton's disk cache) during the timed run")
    parser.add_argument("--launch-config", action="append", default=[], metavar="FIELD=VALUE",
                        help="in-process only: override a field of the CUDA backend's "
                             "TritonLaunchConfig (an int, or 'none'), for A/B runs; repeatable")
    args = parser.parse_args()
    compiles = CompileLog() if args.list_compiles and not args.async_engine else None
    if args.launch_config:
        override_launch_config(args.launch_config)

    from octavo import LLM, SamplingParams
    from octavo.cli.bench import make_workload, workload_vocab_size
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.engine_core.gc_heap import freeze_startup_objects

    def params(out_len: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)

    engine_kwargs = dict(dtype="bfloat16", max_num_seqs=256, load_format=args.load_format,
                         async_scheduling=args.async_scheduling)
    if args.async_engine:
        timeline, elapsed, total_out, cpu_note = run_async_engine(args, engine_kwargs, params)
        path = "AsyncLLM (engine core in its own process)"
    else:
        llm = LLM(args.model, **engine_kwargs)
        freeze_startup_objects()  # as octavo bench does
        engine = llm.llm_engine
        vocab = workload_vocab_size(engine.tokenizer, engine.config.model_config)

        def add(workload, prefix: str) -> int:
            for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
                engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt},
                                   params(out_len), output_kind=RequestOutputKind.FINAL_ONLY)
            return sum(workload.output_lens)

        if args.warmup:
            add(make_workload(32, (16, 64), (16, 64), vocab, 1), "warm")
            while engine.has_unfinished_requests():
                engine.step()

        total_out = add(make_workload(args.num_requests, args.input_len,
                                      args.output_len, vocab, 0), "")
        start = time.perf_counter()
        cpu_start = time.process_time()
        if compiles is not None:
            compiles.mark(start)
        timeline = Timeline(start, args.print_steps)
        while engine.has_unfinished_requests():
            engine.step()
            timeline.record(time.perf_counter(), engine.stats())
        elapsed = time.perf_counter() - start
        cpu_note = (f"this process's CPU {1e3 * (time.process_time() - cpu_start) / timeline.num_steps:.2f}"
                    " ms/step")
        path = "the in-process engine"
    groups, first_steps = timeline.groups, timeline.first_steps
    warm = "after a warm-up" if args.warmup else "no warm-up"
    print(f"{args.num_requests} requests through {path} ({warm}): {total_out} output tokens in "
          f"{elapsed:.2f} s = {total_out / elapsed:,.0f} output tok/s; {timeline.num_steps} steps "
          f"= {1e3 * elapsed / timeline.num_steps:.2f} ms/step; {cpu_note}")
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
    if compiles is not None:
        compiles.report()
    print(json.dumps({"bench": "w1_timeline", "engine": "async" if args.async_engine else "in-process",
                      "warmup": args.warmup, "elapsed_s": elapsed, "output_tokens": total_out,
                      "groups": {n: {"steps": g[0], "seconds": g[1], "decode_tokens": g[2]}
                                 for n, g in groups.items()}}))


def run_async_engine(args, engine_kwargs, params):
    """The same run through AsyncLLM: every per-step message the front end receives is
    timed (its arrival), with the step's scheduler snapshot it carries.

    Returns the timeline, the elapsed seconds (to the last request's final output), the
    output tokens and a note on both processes' CPU time per step.
    """
    from octavo.cli.bench import make_workload, workload_vocab_size
    from octavo.cli.serve import front_end_threads
    from octavo.engine.arg_utils import EngineArgs
    from octavo.engine.async_llm import AsyncLLM
    from octavo.engine.output_processor import RequestOutputKind

    front_end_threads()  # as octavo bench throughput --async-engine and octavo serve
    engine = AsyncLLM(EngineArgs(model=args.model, **engine_kwargs))
    vocab = workload_vocab_size(engine.tokenizer, engine.config.model_config)

    class StepClock:
        """A StatLogger: each call is one engine-core step's message."""

        timeline: Timeline | None = None

        def record(self, scheduler_stats, iteration_stats) -> None:
            if self.timeline is not None:
                self.timeline.record(time.perf_counter(), scheduler_stats)

    clock = StepClock()
    engine.stat_loggers.append(clock)

    async def run(workload, prefix: str) -> int:
        async def one(i: int) -> int:
            num_out = 0
            async for output in engine.generate(
                    {"prompt_token_ids": workload.prompts[i]}, params(workload.output_lens[i]),
                    f"{prefix}{i}", output_kind=RequestOutputKind.FINAL_ONLY):
                num_out = sum(len(c.token_ids) for c in output.outputs)
            return num_out

        return sum(await asyncio.gather(*(one(i) for i in range(len(workload.prompts)))))

    async def main():
        await engine.start()
        try:
            if args.warmup:
                await run(make_workload(32, (16, 64), (16, 64), vocab, 1), "warm")
            workload = make_workload(args.num_requests, args.input_len,
                                     args.output_len, vocab, 0)
            core_pid = engine.core.pid
            core_cpu, front_cpu = cpu_seconds(core_pid), time.process_time()
            start = time.perf_counter()
            clock.timeline = Timeline(start, args.print_steps)
            total_out = await run(workload, "")
            elapsed = time.perf_counter() - start
            steps = clock.timeline.num_steps
            core_cpu = cpu_seconds(core_pid) - core_cpu
            front_cpu = time.process_time() - front_cpu
            note = (f"engine-core process CPU {1e3 * core_cpu / steps:.2f} ms/step, "
                    f"front end CPU {1e3 * front_cpu / steps:.2f} ms/step")
            return clock.timeline, elapsed, total_out, note
        finally:
            await engine.shutdown()

    return asyncio.run(main())


if __name__ == "__main__":
    main()
