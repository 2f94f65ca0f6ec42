"""Start-up time of ``octavo.LLM()`` on the default model (SmolLM2-135M-Instruct GGUF), on the CPU.

    python benchmarks/cpu/bench_startup.py            # 3 fresh processes, median
    python benchmarks/cpu/bench_startup.py --runs 5 --model ./my-model

Each run is a fresh ``python`` process (cold Python imports, warm OS page cache after the
first) that imports ``octavo`` and builds ``LLM(**engine options)``. Prints, per run, the
import time, the ``LLM()`` time (the engine's own INFO lines show the phases: config,
tokenizer, weights, KV cache) and the process's CPU time, then the medians and one JSON line.
A benchmark, not a test: wall times depend on the machine and on what else runs on it (the
load average is printed with each run; on two cores another busy process doubles them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys

# What each fresh process runs: time the import, then LLM(); print one JSON line.
_CHILD = """
import json, sys, time
start = time.perf_counter()
import octavo
imported = time.perf_counter()
llm = octavo.LLM(**json.loads(sys.argv[1]))
ready = time.perf_counter()
print("STARTUP " + json.dumps({"import_s": imported - start, "llm_s": ready - imported,
                               "num_blocks": llm.llm_engine.num_blocks}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="fresh processes to time (default 3)")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--quiet", action="store_true", help="hide the engine's INFO lines")
    args = parser.parse_args()

    kwargs = {"device": "cpu"} | ({"model": args.model} if args.model else {})
    env = dict(os.environ)
    if args.quiet:
        env["OCTAVO_LOG_LEVEL"] = "WARNING"
    imports, llms, cpus = [], [], []
    for run in range(args.runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kwargs)], env=env,
                              stdout=subprocess.PIPE, text=True, check=True)
        line = next(x for x in done.stdout.splitlines() if x.startswith("STARTUP "))
        result = json.loads(line.removeprefix("STARTUP "))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        imports.append(result["import_s"])
        llms.append(result["llm_s"])
        cpus.append(cpu)
        print(f"run {run + 1}: import octavo {result['import_s']:.2f} s, "
              f"LLM() {result['llm_s']:.2f} s, total {result['import_s'] + result['llm_s']:.2f} s "
              f"(process CPU time {cpu:.2f} s, load average {os.getloadavg()[0]:.2f})", flush=True)
    summary = {
        "bench": "startup",
        "model": args.model or "default (SmolLM2-135M-Instruct GGUF)",
        "runs": args.runs,
        "median_import_s": round(statistics.median(imports), 2),
        "median_llm_s": round(statistics.median(llms), 2),
        "median_total_s": round(statistics.median(i + m for i, m in zip(imports, llms)), 2),
        # CPU seconds of the whole child process (less sensitive to other load than wall time).
        "median_cpu_s": round(statistics.median(cpus), 2),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "host": platform.node(),
    }
    print(f"median: import {summary['median_import_s']:.2f} s, LLM() {summary['median_llm_s']:.2f} s, "
          f"total {summary['median_total_s']:.2f} s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
