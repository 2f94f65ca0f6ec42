"""Per-step time breakdown of Octavo on a GPU: GPU busy time vs exposed CPU time.

    python benchmarks/gpu/profile_steps.py --model /tmp/qwen2.5-0.5b-random

Runs the W1-shaped workload until the batch is in steady decode, then times a window of
steps three ways: (0) plain wall time, nothing added; (1) wall time of each phase of a step (scheduler, input preparation, model
forward launch, sampler, output processing), by wrapping those methods with timers that
synchronize the GPU (so with async scheduling these are each phase's host cost, not what is
exposed); (2) torch.profiler over the same number of steps without the synchronizing timers:
total CUDA kernel time vs wall time. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def host_clock(engine, steps: int, structured: bool) -> None:
    """A window of ``steps`` steps with plain (non-synchronizing) timers around the engine
    thread's calls: each call's share of a step's wall time, nested calls apart (the launch
    of a deferred sampling inside its wait, the output processing after the step)."""
    core = engine.engine_core
    seconds: dict[str, float] = defaultdict(float)
    calls: list[tuple[object, str, object, str]] = []

    def clock(obj, name: str, label: str) -> None:
        original = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(obj, name, wrapper)
        calls.append((obj, name, original, label))

    clock(core, "_admit_compiled_grammars", "admit grammars")
    clock(core.scheduler, "schedule", "schedule")
    clock(core, "_constrained_rows", "constrained rows")
    clock(core, "_launch_deferred_sampling", "deferred sampling: wait + launch")
    clock(core.executor, "sample_tokens", "  of which the sampling's launch")
    clock(core.executor, "execute_model_async", "launch step (inputs + forward)")
    clock(core, "_record", "record step")
    if structured:
        clock(core.structured_outputs, "accept_and_bitmask_async", "  of which grammar submit")
    clock(core.scheduler, "update_from_output", "  of which update_from_output")
    clock(engine.output_processor, "process_outputs", "output processing")
    before = core.stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    after = core.stats()
    for obj, name, original, _ in calls:
        setattr(obj, name, original)
    print(f"host clock over {steps} steps: {1e3 * wall / steps:.3f} ms per step")
    accounted = 0.0
    for _, _, _, label in calls:
        total = seconds[label]
        print(f"  {label:<40}{1e3 * total / steps:8.3f} ms")
        if not label.startswith("  "):
            accounted += total
    if structured:
        wait = after.structured_output_wait_s - before.structured_output_wait_s
        work = after.structured_output_work_s - before.structured_output_work_s
        print(f"  {'grammar counters: the engine waited':<40}{1e3 * wait / steps:8.3f} ms "
              f"(their work {1e3 * work / steps:.3f} ms)")
    rest = "the rest (the oldest step's result)"
    print(f"  {rest:<40}"
          f"{1e3 * (wall - accounted) / steps:8.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=120)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="default: the backend's (on for CUDA)")
    parser.add_argument("--stacks", action="store_true",
                        help="also list the ops of most host time with their Python stacks")
    parser.add_argument("--structured", choices=["json"], default=None,
                        help="constrain every request to a JSON schema (round robin over "
                             "octavo.testing.json_schemas) and time the grammar phases too")
    parser.add_argument("--load-format", default="auto",
                        help="'dummy' for a config-only folder (random weights on the GPU)")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (as `octavo serve`)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="every request's output length (default: W1's 100-1024 draw)")
    parser.add_argument("--row-limit", type=int, default=15,
                        help="kernels listed in the profiler's table")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also run the window under cProfile and list the N functions of "
                             "most own time (where the engine thread's CPU per step goes)")
    parser.add_argument("--host-clock", action="store_true",
                        help="also time the engine thread's calls per step in a window without "
                             "synchronizing (what a step's host time is spent on, waits for the "
                             "GPU and for the grammars included)")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="freeze start-up's objects out of the garbage collector's sight "
                             "(octavo.engine_core.gc_heap), as octavo bench does")
    args = parser.parse_args()

    from octavo import LLM, SamplingParams
    from octavo.cli.bench import make_workload
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.sampling_params import StructuredOutputsParams
    from octavo.testing.json_schemas import SCHEMA_CASES

    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=256,
              async_scheduling=args.async_scheduling, load_format=args.load_format,
              quantization=args.quantization)
    if args.gc_freeze:
        # As octavo bench and the engine core's process do (octavo.engine_core.gc_heap).
        from octavo.engine_core.gc_heap import freeze_startup_objects

        freeze_startup_objects()
    engine = llm.llm_engine
    vocab = engine.config.model_config.vocab_size
    workload = make_workload(args.num_requests, (100, 1024), (100, 1024), vocab, 0)
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        out_len = args.output_len or out_len
        # FINAL_ONLY, as LLM.generate (and so `octavo bench throughput`) asks for outputs.
        constraint = None
        if args.structured:
            schema = SCHEMA_CASES[i % len(SCHEMA_CASES)].schema
            constraint = StructuredOutputsParams(json=schema)
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                                          structured_outputs=constraint),
                           output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(args.warmup_steps):
        engine.step()
    stats = engine.stats()
    print(f"after warm-up: {stats.num_running} running, {stats.num_waiting} waiting")

    # (0) plain wall time per step: no timers, no profiler (both add host work)
    torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - start) / args.steps * 1000
    # The engine thread's CPU time (everything runs on it in-process; with async scheduling
    # a step is host-bound when this exceeds the GPU kernel time).
    plain_cpu_ms = (time.thread_time() - start_cpu) / args.steps * 1000
    print(f"plain window: {plain_ms:.3f} ms wall, {plain_cpu_ms:.3f} ms engine-thread CPU "
          "per step")

    if args.host_clock:
        host_clock(engine, args.steps, args.structured is not None)

    if args.cprofile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        stats_ = pstats.Stats(profiler, stream=text)
        stats_.sort_stats("tottime").print_stats(args.cprofile)
        stats_.sort_stats("cumulative").print_stats(args.cprofile)
        print(text.getvalue())

    # (1) phase timers (synchronizing, so each phase's GPU work is attributed to it)
    runner = engine.engine_core.executor.worker.model_runner
    core = engine.engine_core
    phases: dict[str, float] = defaultdict(float)

    def timed(obj, name, label):
        original = getattr(obj, name)

        def wrapper(*a, **k):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = original(*a, **k)
            torch.cuda.synchronize()
            phases[label] += time.perf_counter() - start
            return result

        setattr(obj, name, wrapper)
        return original

    originals = [
        (core.scheduler, "schedule", timed(core.scheduler, "schedule", "schedule")),
        (runner, "_prepare_inputs", timed(runner, "_prepare_inputs", "prepare_inputs")),
        (runner.model, "forward", timed(runner.model, "forward", "model_forward")),
        (runner, "_sample", timed(runner, "_sample", "logits+sample")),
        (core.scheduler, "update_from_output",
         timed(core.scheduler, "update_from_output", "update_from_output")),
        (engine.output_processor, "process_outputs",
         timed(engine.output_processor, "process_outputs", "output_processing")),
    ]
    if args.structured:
        manager = core.structured_outputs
        originals += [
            (manager, "bitmask", timed(manager, "bitmask", "grammar_masks")),
            (manager, "accept_step", timed(manager, "accept_step", "grammar_accept")),
            (core.executor, "sample_tokens",
             timed(core.executor, "sample_tokens", "deferred_sample")),
        ]
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    for _ in range(args.steps):
        tokens += sum(len(o.outputs[0].token_ids) > 0 for o in engine.step())
    torch.cuda.synchronize()
    timed_wall = time.perf_counter() - start
    for obj, name, original in originals:
        setattr(obj, name, original)

    # (2) profiler: kernel time vs wall time, no synchronizing timers
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=args.stacks) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    running = engine.stats().num_running
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.row_limit))
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    print(f"GPU kernels per step: {kernels / args.steps:.1f}")
    if args.stacks:
        print(prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total",
                                                          row_limit=8, max_name_column_width=60))
    print(f"\nphase breakdown over {args.steps} steps ({running} running), ms per step:")
    for label, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<20} {seconds / args.steps * 1000:8.3f}")
    print(f"  {'timed step total':<20} {timed_wall / args.steps * 1000:8.3f}")
    gpu_ms = gpu_us / 1000 / args.steps
    wall_ms = wall / args.steps * 1000
    print(f"\nunprofiled: {plain_ms:.3f} ms per step wall ({max(plain_ms - gpu_ms, 0):.3f} ms "
          "more than the GPU kernel time)")
    print(f"profiled: {wall_ms:.3f} ms per step wall, {gpu_ms:.3f} ms GPU kernel time, "
          f"{max(wall_ms - gpu_ms, 0):.3f} ms exposed CPU/idle")
    print(json.dumps({
        "profile": "decode-steps", "running": running, "steps": args.steps,
        "async_scheduling": engine.config.scheduler_config.async_scheduling,
        "plain_wall_ms_per_step": round(plain_ms, 3),
        "plain_cpu_ms_per_step": round(plain_cpu_ms, 3),
        "wall_ms_per_step": round(wall_ms, 3), "gpu_ms_per_step": round(gpu_ms, 3),
        "phases_ms_per_step": {k: round(v / args.steps * 1000, 3) for k, v in phases.items()},
    }))


if __name__ == "__main__":
    main()
