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

``--structured json`` runs W1 as ``octavo bench throughput --structured json``
does: one untimed one-token request per schema of ``octavo.testing.json_schemas``, the timed
run with request *i* constrained to schema *i* mod 12 (EOS ends it once its JSON is complete),
then the same requests unconstrained with the output lengths the constrained run got, on the
same engine. It prints both timelines with the engine thread's CPU per group, and where a
constrained run spends time an unconstrained one does not: admitting requests (waiting for
their grammars), waiting for the grammar thread before a deferred sampling, and the prompt
tokens found in the prefix cache. With ``--async-engine`` (as ``bench-structured`` runs)
it runs ``--repeat N`` such pairs through ``AsyncLLM`` on one engine and prints each run's
per-group seconds side by side with the engine core's grammar counters
(``SchedulerStats.structured_output_*``) and the front end's collector time: where a slow
constrained run lost its time. For a CPU proxy of the H100 run: ``--tokenizer
.bench-assets/smollm2-tokenizer`` (a tiny Llama with SmolLM2's vocabulary, so the grammar work
is the real one) and ``--fast-sample`` (no LM head; each constrained row picks an allowed
token from its mask: ``benchmarks/cpu/profile_host_steps.py``), e.g.

    python benchmarks/gpu/w1_timeline.py --structured json --tokenizer \
        .bench-assets/smollm2-tokenizer --fast-sample --dtype float32 --cpu-threads 1 \
        --num-requests 128 --input-len 50:512 --output-len 50:512 --max-num-seqs 128
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
        self.last_cpu = time.thread_time()
        self.last_running = 0
        self.print_steps = print_steps
        # steps, s, tokens, this thread's CPU s
        self.groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
        self.first_steps: list[tuple[float, int, int, int]] = []

    def record(self, now: float, stats) -> None:
        # The step just scheduled: a pure decode step schedules one token per running request
        # (counted before the step: with async scheduling a request that stops on a sampled
        # token, EOS, had one more token scheduled while it was still running).
        decode = (stats.num_waiting == 0
                  and stats.num_batched_tokens <= max(stats.num_running, self.last_running))
        self.last_running = stats.num_running
        group = self.groups[band(max(stats.num_running, 1)) if decode else "prefill or mixed"]
        group[0] += 1
        group[1] += now - self.last
        group[2] += stats.num_running if decode else 0
        cpu = time.thread_time()
        group[3] += cpu - self.last_cpu
        self.last_cpu = cpu
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
    parser.add_argument("--model", default=None,
                        help="a model folder (required unless --tokenizer makes a tiny Llama)")
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
    parser.add_argument("--structured", choices=["json"], default=None,
                        help="the constrained run, then the same requests unconstrained (as "
                             "octavo bench throughput --structured json)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="with --structured --async-engine: N pairs of runs on one engine")
    parser.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="with --structured: empty the prefix cache before each timed run, "
                             "as octavo bench throughput does (--no-reset-prefix-cache: the "
                             "unconstrained run finds the constrained run's prompts cached, as "
                             "the bench did before)")
    parser.add_argument("--tokenizer", default=None,
                        help="CPU proxy: a tiny Llama with this saved tokenizer's vocabulary "
                             "(benchmarks/cpu/profile_host_steps.py), made in the temp dir")
    parser.add_argument("--fast-sample", action="store_true",
                        help="CPU proxy: no LM head; constrained rows pick an allowed token "
                             "(benchmarks/cpu/profile_host_steps.py)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--cpu-threads", type=int, default=None)
    args = parser.parse_args()
    if args.model is None and args.tokenizer is None:
        parser.error("--model or --tokenizer is needed")
    if args.tokenizer is not None and args.model is None:
        import tempfile
        from pathlib import Path

        args.model = str(_cpu_helpers().make_model(
            Path(tempfile.gettempdir()) / f"octavo-host-llama-{Path(args.tokenizer).name}",
            args.tokenizer))
    compiles = CompileLog() if args.list_compiles and not args.async_engine else None
    if args.launch_config:
        override_launch_config(args.launch_config)

    from octavo import LLM, SamplingParams
    from octavo.cli.bench import make_workload, workload_vocab_size
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.engine_core.gc_heap import freeze_startup_objects

    def params(out_len: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)

    engine_kwargs = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                         load_format=args.load_format, async_scheduling=args.async_scheduling)
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.cpu_threads is not None:
        engine_kwargs["cpu_threads"] = args.cpu_threads
    if args.structured:
        if args.async_engine:
            run_structured_async(args, engine_kwargs)
        else:
            run_structured(args, engine_kwargs)
        return
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
        steps, seconds, tokens, _ = groups[name]
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


def _cpu_helpers():
    """benchmarks/cpu/profile_host_steps.py, for its tiny Llama and its fast sampling."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "cpu" / "profile_host_steps.py"
    spec = importlib.util.spec_from_file_location("profile_host_steps", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GrammarClock:
    """What a constrained run spends that an unconstrained one does not, on the engine
    thread: admitting compiled requests (``_admit_compiled_grammars``, its ``wait`` for
    pending compilations apart) and waiting for the grammar thread (accept + fill) before a
    deferred sampling; and steps with requests still waiting for their grammar."""

    def __init__(self, core) -> None:
        self.core = core
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._wrap(core, "_admit_compiled_grammars", "admit")
        self._wrap(core.structured_outputs, "wait", "compile_wait")
        self._wrap(core.structured_outputs, "take_ready", "take_ready")
        self._wrap(core, "_constrained_rows", "constrained_rows")
        original = core._launch_deferred_sampling

        def launch():
            pending = core._grammar_step
            if pending is not None:
                start = time.perf_counter()
                pending.result()
                self.seconds["grammar_wait"] += time.perf_counter() - start
                self.counts["grammar_wait"] += 1
            return original()

        core._launch_deferred_sampling = launch

    def _wrap(self, obj, name: str, label: str) -> None:
        original = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.counts[label] += 1

        setattr(obj, name, wrapper)

    def after_step(self) -> None:
        if self.core._awaiting_grammar:
            self.counts["steps_with_requests_awaiting_grammar"] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


def run_structured(args, engine_kwargs) -> None:
    """``--structured json``: the constrained run, then the same requests unconstrained."""
    import torch
    from octavo import LLM, SamplingParams
    from octavo.cli.bench import (
        _json_schema_params,
        _warmup_workload,
        make_workload,
        workload_vocab_size,
    )
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.engine_core.gc_heap import freeze_startup_objects
    from octavo.testing.json_schemas import SCHEMA_CASES

    llm = LLM(args.model, **engine_kwargs)
    freeze_startup_objects()
    engine = llm.llm_engine
    core = engine.engine_core
    if args.fast_sample:
        runner = core.executor.worker.model_runner
        _cpu_helpers()._fast_sample(runner, engine.config.model_config.vocab_size)
        # Its logits buffer grown to the largest step now, not inside the first timed run.
        runner.model.compute_logits(torch.empty(args.max_num_seqs, 1))
    vocab = workload_vocab_size(engine.tokenizer, engine.config.model_config)
    workload = make_workload(args.num_requests, args.input_len, args.output_len, vocab, 0)
    clock = GrammarClock(core)

    def run(params, prefix: str, timed: bool) -> tuple[dict[str, int], dict]:
        lens: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(zip(workload.prompts, params)):
            engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt}, sp,
                               output_kind=RequestOutputKind.FINAL_ONLY)
        if args.reset_prefix_cache and timed:
            core.scheduler.kv_cache_manager.reset_prefix_cache()
        clock.reset()
        before = engine.stats()
        start = time.perf_counter()
        cpu_start = time.thread_time()
        timeline = Timeline(start, args.print_steps)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    lens[output.request_id] = sum(len(c.token_ids) for c in output.outputs)
            clock.after_step()
            timeline.record(time.perf_counter(), engine.stats())
        after = engine.stats()
        result = {"elapsed_s": time.perf_counter() - start,
                  "cpu_s": time.thread_time() - cpu_start,
                  "steps": timeline.num_steps, "output_tokens": sum(lens.values()),
                  "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
                  "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
                  "grammar_s": dict(clock.seconds), "grammar_counts": dict(clock.counts),
                  "groups": {n: {"steps": g[0], "seconds": g[1], "decode_tokens": g[2],
                                 "cpu_s": g[3]} for n, g in timeline.groups.items()}}
        for i, (ms, running, waiting, batched) in enumerate(timeline.first_steps):
            print(f"{prefix} step {i:>3}: {ms:8.2f} ms  running {running:>3}  "
                  f"waiting {waiting:>3}  scheduled tokens {batched}")
        return lens, result

    if args.warmup:
        warm = make_workload(32, (16, 64), (16, 64), vocab, 1)
        for i, (prompt, n) in enumerate(zip(warm.prompts, warm.output_lens)):
            engine.add_request(f"warm{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    # As octavo bench: one one-token request per schema (the grammar tables, compilations).
    warm = _warmup_workload(workload)
    for i, (prompt, sp) in enumerate(zip(warm.prompts,
                                         _json_schema_params([1] * len(SCHEMA_CASES)))):
        engine.add_request(f"schema{i}", {"prompt_token_ids": prompt}, sp)
    while engine.has_unfinished_requests():
        engine.step()

    lens, constrained = run(_json_schema_params(workload.output_lens), "json", True)
    out_lens = [max(lens[f"json{i}"], 1) for i in range(len(workload.prompts))]
    _, free = run([SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                   for n in out_lens], "free", True)
    print(f"{args.num_requests} requests in-process, --structured json"
          f"{', prefix cache reset before each run' if args.reset_prefix_cache else ''}")
    print(f"{'':<22}{'json':>22}{'unconstrained':>22}")
    for label, key in (("elapsed s", "elapsed_s"), ("engine-thread CPU s", "cpu_s"),
                       ("steps", "steps"), ("output tokens", "output_tokens"),
                       ("prompt tokens queried", "prefix_cache_queries"),
                       ("  found cached", "prefix_cache_hits")):
        print(f"{label:<22}{constrained[key]:>22,.3f}{free[key]:>22,.3f}")
    groups = sorted(set(constrained["groups"]) | set(free["groups"]),
                    key=lambda n: (n.startswith("decode"), int(n.split()[1].split("-")[0])
                                   if n.startswith("decode") else 0))
    print(f"{'group':<22}{'steps':>7}{'s':>8}{'cpu ms/st':>10}{'steps':>12}{'s':>8}"
          f"{'cpu ms/st':>10}{'extra s':>9}")
    empty = {"steps": 0, "seconds": 0.0, "cpu_s": 0.0}
    for name in groups:
        a, b = constrained["groups"].get(name, empty), free["groups"].get(name, empty)
        print(f"{name:<22}{a['steps']:>7}{a['seconds']:>8.2f}"
              f"{1e3 * a['cpu_s'] / max(a['steps'], 1):>10.2f}{b['steps']:>12}{b['seconds']:>8.2f}"
              f"{1e3 * b['cpu_s'] / max(b['steps'], 1):>10.2f}{a['seconds'] - b['seconds']:>9.2f}")
    print("json run, engine thread: " + ", ".join(
        f"{k} {v:.3f} s ({constrained['grammar_counts'].get(k, 0)} calls)"
        for k, v in constrained["grammar_s"].items())
          + f"; steps with requests awaiting their grammar "
            f"{constrained['grammar_counts'].get('steps_with_requests_awaiting_grammar', 0)}")
    ratio = ((constrained["output_tokens"] / constrained["elapsed_s"])
             / (free["output_tokens"] / free["elapsed_s"]))
    print(f"ratio json / unconstrained output tok/s: {ratio:.2f}x")
    print(json.dumps({"bench": "w1_timeline", "structured": "json",
                      "reset_prefix_cache": args.reset_prefix_cache, "ratio": ratio,
                      "json": constrained, "unconstrained": free}))
    engine.shutdown()


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


class StepClock:
    """A StatLogger for AsyncLLM: each call is one engine-core step's message, filed in
    ``timeline`` while one is set."""

    timeline: Timeline | None = None

    def record(self, scheduler_stats, iteration_stats) -> None:
        if self.timeline is not None:
            self.timeline.record(time.perf_counter(), scheduler_stats)


class FrontEndGC:
    """This process's cyclic-collector time (``gc.callbacks``) since ``reset``."""

    def __init__(self) -> None:
        import gc

        self.seconds = 0.0
        self.count = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.count += 1

    def reset(self) -> None:
        self.seconds = 0.0
        self.count = 0


def _band_order(name: str) -> tuple[bool, int]:
    return name.startswith("decode"), int(name.split()[1].split("-")[0]) \
        if name.startswith("decode") else 0


def run_structured_async(args, engine_kwargs) -> None:
    """``--structured json --async-engine``: ``--repeat`` pairs of runs through AsyncLLM on one
    engine, as ``octavo bench throughput --structured json --async-engine`` runs one pair (the
    prefix cache emptied before each run), each run's per-step messages timed by group, with
    the engine core's grammar counters (``SchedulerStats.structured_output_*``): which part of
    a run a slow constrained run lost its time in."""
    from octavo import SamplingParams
    from octavo.cli.bench import (
        _json_schema_params,
        _warmup_workload,
        make_workload,
        workload_vocab_size,
    )
    from octavo.cli.serve import front_end_threads
    from octavo.engine.arg_utils import EngineArgs
    from octavo.engine.async_llm import AsyncLLM
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.testing.json_schemas import SCHEMA_CASES

    front_end_threads()
    engine = AsyncLLM(EngineArgs(model=args.model, **engine_kwargs))
    vocab = workload_vocab_size(engine.tokenizer, engine.config.model_config)
    workload = make_workload(args.num_requests, args.input_len, args.output_len, vocab, 0)

    clock = StepClock()
    engine.stat_loggers.append(clock)
    gc_clock = FrontEndGC()

    async def run(prompts, params, prefix: str, timed: bool) -> dict:
        async def one(i: int) -> int:
            num_out = 0
            async for output in engine.generate({"prompt_token_ids": prompts[i]}, params[i],
                                                f"{prefix}{i}",
                                                output_kind=RequestOutputKind.FINAL_ONLY):
                num_out = sum(len(c.token_ids) for c in output.outputs)
            return num_out

        if timed:
            await engine.reset_prefix_cache()
        before = engine.scheduler_stats
        core_cpu = cpu_seconds(engine.core.pid)
        gc_clock.reset()
        start = time.perf_counter()
        clock.timeline = Timeline(start, 0) if timed else None
        lens = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        elapsed = time.perf_counter() - start
        after = engine.scheduler_stats
        timeline, clock.timeline = clock.timeline, None
        return {"elapsed_s": elapsed, "lens": list(lens),
                "core_cpu_s": cpu_seconds(engine.core.pid) - core_cpu,
                "front_end_gc_s": gc_clock.seconds, "front_end_gc_collections": gc_clock.count,
                "grammar_steps": after.structured_output_steps - before.structured_output_steps,
                "grammar_wait_s": after.structured_output_wait_s - before.structured_output_wait_s,
                "grammar_work_s": after.structured_output_work_s - before.structured_output_work_s,
                "groups": {} if timeline is None else
                {n: {"steps": g[0], "seconds": g[1]} for n, g in timeline.groups.items()}}

    async def main() -> list[tuple[dict, dict]]:
        await engine.start()
        pairs = []
        try:
            warm = _warmup_workload(workload)
            await run(warm.prompts, _json_schema_params([1] * len(SCHEMA_CASES)), "schema",
                      False)
            for r in range(args.repeat):
                constrained = await run(workload.prompts,
                                        _json_schema_params(workload.output_lens), f"json{r}-",
                                        True)
                free = await run(workload.prompts,
                                 [SamplingParams(temperature=0.0, max_tokens=max(n, 1),
                                                 ignore_eos=True) for n in constrained["lens"]],
                                 f"free{r}-", True)
                pairs.append((constrained, free))
                ratio = ((sum(constrained["lens"]) / constrained["elapsed_s"])
                         / (sum(free["lens"]) / free["elapsed_s"]))
                print(f"pair {r}: json {constrained['elapsed_s']:.3f} s, unconstrained "
                      f"{free['elapsed_s']:.3f} s, ratio {ratio:.2f}x; engine core CPU "
                      f"{constrained['core_cpu_s']:.2f} / {free['core_cpu_s']:.2f} s; "
                      f"front-end GC {constrained['front_end_gc_s']:.3f} / "
                      f"{free['front_end_gc_s']:.3f} s; grammar "
                      f"{constrained['grammar_steps']} steps, waited "
                      f"{constrained['grammar_wait_s']:.3f} s for "
                      f"{constrained['grammar_work_s']:.3f} s of work", flush=True)
        finally:
            await engine.shutdown()
        return pairs

    pairs = asyncio.run(main())
    names = sorted({n for pair in pairs for run_ in pair for n in run_["groups"]},
                   key=_band_order)
    print("seconds per group, json / unconstrained, each pair:")
    print(f"{'group':<22}" + "".join(f"{f'pair {r}':>16}" for r in range(len(pairs))))
    for name in names:
        cells = []
        for constrained, free in pairs:
            a = constrained["groups"].get(name, {"seconds": 0.0})["seconds"]
            b = free["groups"].get(name, {"seconds": 0.0})["seconds"]
            cells.append(f"{a:.3f}/{b:.3f}")
        print(f"{name:<22}" + "".join(f"{c:>16}" for c in cells))
    for constrained, free in pairs:
        constrained.pop("lens")
        free.pop("lens")
    print(json.dumps({"bench": "w1_timeline", "structured": "json", "engine": "async",
                      "pairs": pairs}))


if __name__ == "__main__":
    main()
