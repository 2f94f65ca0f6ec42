"""The engine core's host work per steady decode step, on the CPU, phase by phase.

    python benchmarks/cpu/profile_host_steps.py [--structured json] [--windows 5]

A tiny random-weight Llama (hidden 64, 2 layers, octavo.testing.tiny_models) runs 256 requests
(short prompts, long outputs, greedy, EOS ignored) until every request is in steady decode;
then windows of ``--steps`` steps are timed, each phase by a timer wrapped around the method
that does it (no device sync is needed: the CPU backend computes as it is called). The forward
pass of such a model is a small part of a step, so what is left is the Python the engine runs
per step for 256 requests, the same code a GPU step runs on its host. Prints per-phase µs per
step (the median over the windows, and the spread) and one JSON line.

Phases: ``schedule`` (Scheduler.schedule), ``update_states`` and ``prepare_inputs`` (the model
runner's per-request state and flat batch), ``forward``, ``sample`` (logits, sampler, the
result's host copies), ``finalize`` (the runner output from the host copies),
``update_from_output`` (recording the step, building EngineCoreOutputs), ``grammar_fill`` /
``grammar_accept`` (structured outputs), ``grammar_wait`` (the engine thread waiting for the
grammar thread before a deferred sampling, async scheduling only), ``output_processing`` (the front end's per-step
work) and ``other`` (the step's wall time less these). Structured outputs add, on the engine
thread: ``grammar_rows`` (the engine core's bookkeeping: which rows need masks, handing the
step's sampled tokens to the grammar thread or process) and ``grammar_apply`` (the
runner's masks: their rows, the upload and ``mask_by_bitmask``, taken out of ``sample``); with
``--fast-sample``, ``fast_sample_pick`` is the stand-in for ``mask_by_bitmask`` that picks an
allowed token per row (numpy work a GPU host does not do), and the greedy argmax takes the
picks without reading the logits (random tokens for unconstrained rows).

``--clock cpu`` times with the engine thread's CPU time (``time.thread_time``) instead of wall
time: on a machine shared with other jobs, time the thread spends descheduled is left out
(the grammar engine's own mask threads are then not counted: ``grammar_fill`` is the engine
thread's part of it).

With ``--async-scheduling --structured json`` the grammar thread accepts the tokens and fills
the masks beside the engine thread: ``grammar_*`` then count that thread's time, and ``other``
(the step less the phases) can come out negative. The grammars run on the engine core's threads
here (``OCTAVO_GRAMMAR_PROCESS=0`` unless set otherwise: the phases time the in-process
manager's methods). With ``OCTAVO_GRAMMAR_PROCESS=1`` the grammar process's work is out of
sight: ``grammar_fill`` and ``grammar_accept`` are then 0 and only the engine thread's part is
timed (``grammar_rows``, ``grammar_apply``, and ``grammar_wait`` for the process's answer).

``--py-spy OUT.svg`` records the timed windows with ``py-spy record --native`` (subprocess
attached to this process) as well.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

_PHASES = ("schedule", "update_states", "prepare_inputs", "forward", "sample", "finalize",
           "update_from_output", "grammar_rows", "grammar_apply", "fast_sample_pick",
           "grammar_fill", "grammar_accept", "grammar_wait", "output_processing")


def make_model(folder: Path, tokenizer_dir: str | None = None) -> Path:
    """The tiny Llama; with ``tokenizer_dir``, its vocabulary sized to that tokenizer (SmolLM2's:
    49,152 tokens that spell JSON, so a constrained step's grammar work is the real one)."""
    from octavo.testing.tiny_models import make_tiny_model

    if (folder / "config.json").exists():
        return folder
    if tokenizer_dir is None:
        make_tiny_model(folder, "llama", max_position_embeddings=4096)
        return folder
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    make_tiny_model(folder, "llama", max_position_embeddings=4096,
                    vocab_size=-(-len(tokenizer) // 64) * 64, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    os.environ.setdefault("OCTAVO_GRAMMAR_PROCESS", "0")  # see the module docstring
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a model folder (default: a tiny Llama made in the temp dir)")
    parser.add_argument("--tokenizer", default=None,
                        help="a saved tokenizer folder for the tiny Llama (its vocabulary sized "
                             "to it), e.g. .bench-assets/smollm2-tokenizer "
                             "(benchmarks/gpu/export_tokenizer.py)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--steps", type=int, default=60, help="steps per timed window")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--structured", choices=["json"], default=None,
                        help="constrain every request to a JSON schema (round robin over "
                             "octavo.testing.json_schemas)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=False)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: time.perf_counter; cpu: the engine thread's CPU time")
    parser.add_argument("--py-spy", metavar="OUT", default=None,
                        help="also record the timed windows with py-spy (--native; a .svg "
                             "flame graph, or raw/speedscope by the extension)")
    parser.add_argument("--fast-sample", action="store_true",
                        help="replace the LM head, the mask's application and the greedy "
                             "argmax (tens of ms of torch work per step for 256 rows of a 49k "
                             "vocabulary on one core, which also flush the caches) by a pick "
                             "of an allowed token per row from the bitmask (numpy, ~1 ms) and "
                             "random tokens for the other rows: the host's Python and the "
                             "grammar work then make up the step, as on a GPU host; tokens "
                             "are not the model's")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="after the timed windows, run one more window under cProfile "
                             "(the engine thread only) and list its N top functions by own "
                             "time and by cumulative time")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="freeze start-up's objects out of the garbage collector's sight "
                             "(octavo.engine_core.gc_heap), as octavo bench does")
    args = parser.parse_args()

    from octavo import LLM, SamplingParams
    from octavo.engine.output_processor import RequestOutputKind
    from octavo.sampling_params import StructuredOutputsParams
    from octavo.testing.json_schemas import SCHEMA_CASES

    default_folder = ("octavo-host-llama" if args.tokenizer is None
                      else f"octavo-host-llama-{Path(args.tokenizer).name}")
    model = args.model or str(make_model(Path(tempfile.gettempdir()) / default_folder,
                                         args.tokenizer))
    num_windows = args.windows + (1 if args.cprofile else 0)
    steps_needed = args.warmup_steps + args.steps * num_windows + 8
    max_model_len = args.prompt_len + steps_needed + 16
    llm = LLM(model, dtype="float32", max_num_seqs=args.num_requests,
              max_num_batched_tokens=max(args.num_requests * args.prompt_len, 2048),
              max_model_len=max_model_len, async_scheduling=args.async_scheduling,
              cpu_threads=1, enable_prefix_caching=True)
    if args.gc_freeze:
        # As octavo bench and the engine core's process do (octavo.engine_core.gc_heap).
        from octavo.engine_core.gc_heap import freeze_startup_objects

        freeze_startup_objects()
    engine = llm.llm_engine
    vocab = engine.config.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for i in range(args.num_requests):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()
        constraint = None
        if args.structured:
            constraint = StructuredOutputsParams(json=SCHEMA_CASES[i % len(SCHEMA_CASES)].schema)
        # FINAL_ONLY, as LLM.generate asks; EOS ignored so every request stays in decode.
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=steps_needed,
                                          ignore_eos=True, structured_outputs=constraint),
                           output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(args.warmup_steps):
        engine.step()
    running = engine.stats().num_running
    print(f"after warm-up: {running} running, {engine.stats().num_waiting} waiting",
          file=sys.stderr)

    core = engine.engine_core
    runner = core.executor.worker.model_runner
    phases: dict[str, float] = defaultdict(float)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    def timed(obj, name, label, parent=None):
        """Time ``obj.name`` under ``label``; for a call made inside ``parent``'s phase, its
        time moves from there."""
        original = getattr(obj, name)

        def wrapper(*a, **k):
            start = clock()
            try:
                return original(*a, **k)
            finally:
                spent = clock() - start
                phases[label] += spent
                if parent is not None:
                    phases[parent] -= spent

        setattr(obj, name, wrapper)

    if args.fast_sample:
        _fast_sample(runner, vocab)
    timed(core.scheduler, "schedule", "schedule")
    timed(runner, "_update_states", "update_states")
    timed(runner, "_prepare_inputs", "prepare_inputs")
    timed(runner, "_forward", "forward")
    timed(runner, "_sample", "sample")
    timed(core.scheduler, "update_from_output", "update_from_output")
    timed(engine.output_processor, "process_outputs", "output_processing")
    chain: list[dict[str, float]] = []
    if args.structured:
        manager = core.structured_outputs
        if hasattr(manager, "_fill"):  # the in-process manager; a GrammarProcess's are unseen
            timed(manager, "_fill", "grammar_fill")
            timed(manager, "_advance", "grammar_accept")
        timed(core, "_constrained_rows", "grammar_rows")
        timed(manager, "accept_and_bitmask_async", "grammar_rows")
        from octavo.worker import model_runner

        timed(model_runner, "mask_by_bitmask",
              "fast_sample_pick" if args.fast_sample else "grammar_apply", "sample")
        if hasattr(runner, "grammar_masks"):  # the greedy path's masks to the device
            timed(runner.grammar_masks, "upload", "grammar_apply", "sample")
        chain = _time_grammar_chain(core, phases, clock)
    _time_finalize(runner, phases, clock)

    # The cyclic garbage collector's pauses, per generation (gc.callbacks), in the windows.
    gc_time = defaultdict(float)
    gc_count = defaultdict(int)
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = clock()
        else:
            gc_time[info["generation"]] += clock() - gc_start[0]
            gc_count[info["generation"]] += 1

    spy = None
    if args.py_spy:
        spy = subprocess.Popen(["py-spy", "record", "--native", "-r", "200", "-p",
                                str(os.getpid()), "-o", args.py_spy]
                               + (["-f", "speedscope"] if args.py_spy.endswith(".json") else [])
                               + (["-f", "raw"] if args.py_spy.endswith(".txt") else []),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    windows: list[dict[str, float]] = []
    gc.callbacks.append(on_gc)
    for _ in range(args.windows):
        phases.clear()
        start = clock()
        for _ in range(args.steps):
            engine.step()
        wall = clock() - start
        per_step = {label: phases.get(label, 0.0) / args.steps * 1e6 for label in _PHASES}
        per_step["other"] = wall / args.steps * 1e6 - sum(per_step.values())
        per_step["step"] = wall / args.steps * 1e6
        windows.append(per_step)
    gc.callbacks.remove(on_gc)
    if spy is not None:
        spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
        spy.wait(timeout=60)
    running = engine.stats().num_running
    label = "json" if args.structured else "unconstrained"
    print(f"\nhost µs per step, {running} running, {label}, "
          f"async scheduling {'on' if args.async_scheduling else 'off'}, {args.clock} clock, "
          f"{args.windows} windows of {args.steps} steps: median (min-max)")
    medians = {}
    for name in (*_PHASES, "other", "step"):
        values = [w[name] for w in windows]
        if name.startswith(("grammar", "fast_sample")) and not args.structured:
            continue
        medians[name] = statistics.median(values)
        print(f"  {name:<20} {medians[name]:9.0f}   ({min(values):.0f}-{max(values):.0f})")
    num_steps = args.steps * args.windows
    mean_step = statistics.mean(w["step"] for w in windows)
    print(f"  {'step, mean of all':<20} {mean_step:9.0f}   (the stalls of full collections "
          "included, which the medians above leave out)")
    print("  garbage collector (inside the phases above): "
          + ", ".join(f"gen{g} {gc_count[g]} runs {gc_time[g] / num_steps * 1e6:.0f} µs/step"
                      for g in sorted(gc_count)))
    chain_us = _chain_summary(chain) if chain else {}
    if chain_us:
        print("  grammar chain, median µs: " + ", ".join(
            f"{k} {v:.0f}" for k, v in chain_us.items()))
    print(json.dumps({"profile": "host-steps", "structured": args.structured,
                      "grammar_accept_mode": os.environ.get("OCTAVO_GRAMMAR_ACCEPT", ""),
                      "grammar_switch_interval_us": os.environ.get(
                          "OCTAVO_GRAMMAR_SWITCH_INTERVAL_US", ""),
                      "grammar_chain_us": {k: round(v) for k, v in chain_us.items()},
                      "async_scheduling": args.async_scheduling, "clock": args.clock,
                      "running": running,
                      "us_per_step": {k: round(v) for k, v in medians.items()},
                      "mean_step_us": round(mean_step),
                      "gc_us_per_step": {f"gen{g}": round(gc_time[g] / num_steps * 1e6)
                                         for g in sorted(gc_count)}}))
    if args.cprofile:
        _cprofile_window(engine, args.steps, args.cprofile)
    llm.llm_engine.shutdown()


def _cprofile_window(engine, steps: int, top: int) -> None:
    """One more window of ``steps`` steps under cProfile (the engine thread: cProfile sees
    only the thread that enables it), its ``top`` functions by own and cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    print(text.getvalue())


def _time_grammar_chain(core, phases, clock) -> list[dict[str, float]]:
    """Time the engine thread's wait for the grammar thread (accept + fill) before it
    launches a deferred sampling (the future's ``result()``, called first: it is idempotent),
    and record each step's chain on one clock (``time.perf_counter``): submitted, accept
    start/end, fill start/end, wait start/end. Returns the list the records go to."""
    manager = core.structured_outputs
    chain: list[dict[str, float]] = []
    current: dict[str, float] = {}
    now = time.perf_counter

    def wrap(obj, name, label):
        original = getattr(obj, name)

        def wrapper(*a, **k):
            current[label + "_start"] = now()
            try:
                return original(*a, **k)
            finally:
                current[label + "_end"] = now()

        setattr(obj, name, wrapper)

    submit = manager.accept_and_bitmask_async

    def accept_and_bitmask_async(*a, **k):
        current.clear()
        current["submitted"] = now()
        return submit(*a, **k)

    manager.accept_and_bitmask_async = accept_and_bitmask_async
    if hasattr(manager, "_fill"):  # the in-process manager; a GrammarProcess's are unseen
        wrap(manager, "_advance", "accept")
        wrap(manager, "_fill", "fill")
    original = core._launch_deferred_sampling

    def launch():
        pending = core._grammar_step
        if pending is not None:
            start = clock()
            current["wait_start"] = now()
            pending.result()
            current["wait_end"] = now()
            phases["grammar_wait"] += clock() - start
            if "submitted" in current:
                chain.append(dict(current))
        return original()

    core._launch_deferred_sampling = launch
    return chain


def _chain_summary(chain: list[dict[str, float]]) -> dict[str, float]:
    """Medians (µs) of the grammar chain's parts: ``start_delay`` (submitted -> the grammar
    thread starts accepting: it waits for the GIL), ``accept``, ``fill``, ``done_delay``
    (fill done -> the engine thread's wait returns, when it was already waiting), the
    engine thread's ``wait`` and ``submit_to_wait`` (the engine thread's own work between)."""
    parts = defaultdict(list)
    for c in chain:
        if not all(k in c for k in ("accept_start", "accept_end", "fill_start", "fill_end")):
            continue
        parts["start_delay"].append(c["accept_start"] - c["submitted"])
        parts["accept"].append(c["accept_end"] - c["accept_start"])
        parts["fill"].append(c["fill_end"] - c["fill_start"])
        parts["chain"].append(c["fill_end"] - c["submitted"])
        parts["submit_to_wait"].append(c["wait_start"] - c["submitted"])
        parts["wait"].append(c["wait_end"] - c["wait_start"])
        if c["wait_start"] < c["fill_end"]:
            parts["done_delay"].append(c["wait_end"] - c["fill_end"])
    return {k: statistics.median(v) * 1e6 for k, v in parts.items()} | {
        "steps_waited_for_fill": len(parts["done_delay"]), "steps": len(parts["wait"])}


def _fast_sample(runner, vocab: int) -> None:
    """``--fast-sample``: logits of zeros (no LM head) and, for constrained rows, a large
    logit on one token the row's bitmask allows (the first set bit at or after a random word),
    so the greedy argmax follows the grammar like a random model would."""
    import numpy as np
    from octavo.worker import model_runner

    rng = np.random.default_rng(0)
    # One buffer of zeros kept (a fresh 50 MB tensor per step costs its page faults); the
    # logits the last pick set are zeroed again.
    buffer = torch.zeros(0, vocab)
    picked: list[tuple[torch.Tensor, torch.Tensor]] = []

    def compute_logits(hidden):
        nonlocal buffer
        if buffer.shape[0] < hidden.shape[0]:
            buffer = torch.zeros(hidden.shape[0], vocab)
        while picked:
            rows, tokens = picked.pop()
            buffer[rows, tokens] = 0.0
        return buffer[: hidden.shape[0]]

    def pick_allowed(logits, row_ids, bitmask):
        words = bitmask.numpy().view(np.uint32)  # [k, words]
        k, num_words = words.shape
        start = rng.integers(0, num_words, size=k)
        word_index = _first_nonzero_from(words, start)
        word = words[np.arange(k), word_index].astype(np.int64)
        bit = np.log2(word & -word).astype(np.int64)
        tokens = torch.from_numpy(word_index * 32 + bit)
        if row_ids is None:  # every row, in order
            row_ids = torch.arange(k)
        logits[row_ids, tokens] = 1e9
        picked.append((row_ids, tokens))

    def argmax_rows(logits):
        """The greedy pick without reading the logits: the constrained rows' picked tokens,
        random ones elsewhere (as a random model's argmax; EOS is ignored)."""
        tokens = torch.from_numpy(rng.integers(3, vocab, size=logits.shape[0]))
        if picked:
            rows, chosen = picked[-1]
            tokens[rows] = chosen
        return tokens

    runner.model.compute_logits = compute_logits
    model_runner.mask_by_bitmask = pick_allowed
    model_runner.argmax_rows = argmax_rows


def _first_nonzero_from(words, start, window: int = 64):
    """Per row of ``words`` [k, n], the index of its first nonzero word at or after
    ``start`` [k] (wrapping around). Most rows of a grammar's mask have one within a few
    words, so a window of words is looked at first and only the other rows whole: the same
    result as scanning every row whole (a [k, n] gather, ~2 ms for 256 rows of 1,536 words),
    in a fraction of the time."""
    import numpy as np

    k, num_words = words.shape
    found = np.zeros(k, dtype=bool)
    word_index = np.zeros(k, dtype=np.int64)
    todo = np.arange(k)
    for width in (min(window, num_words), num_words):
        order = (start[todo, None] + np.arange(width)[None, :]) % num_words
        nonzero = np.take_along_axis(words[todo], order, axis=1) != 0
        first = nonzero.argmax(axis=1)
        word_index[todo] = order[np.arange(len(todo)), first]
        found[todo] = nonzero.any(axis=1)
        todo = np.flatnonzero(~found)
        if not todo.size:
            break
    return word_index


def _time_finalize(runner, phases, clock) -> None:
    """Time each step's ``finalize`` (turning the host copies into a ModelRunnerOutput)."""
    from octavo.worker import async_output

    original_init = async_output.PendingStepOutput.__init__

    def init(self, copies, finalize, previous, sampled_token_ids):
        def timed_finalize(host):
            start = clock()
            try:
                return finalize(host)
            finally:
                phases["finalize"] += clock() - start

        original_init(self, copies, timed_finalize, previous, sampled_token_ids)

    async_output.PendingStepOutput.__init__ = init


if __name__ == "__main__":
    main()
