"""The API process's per-step output path, alone: CPU per request-step.

    python benchmarks/cpu/bench_output_path.py                  # one API process's metrics
    python benchmarks/cpu/bench_output_path.py --multiprocess   # as with --api-server-count > 1

What ``AsyncLLM``'s output loop does with one ``EngineCoreOutputs`` message, for
``--num-requests`` streamed (DELTA, n = 1, text only) requests over ``--num-steps`` steps of
one token each: ``OutputProcessor.process_outputs`` (detokenization, deltas, per-request
``RequestOutput``s), each output handed to its ``RequestOutputCollector`` (the consumer takes
one every ``--take-every`` steps, so the others merge, as when the API process lags), and
``PrometheusStatLogger.record``; ``--stream-interval`` as the engine's. No sockets, no HTTP,
no engine core: the figure holds still on a shared machine (CPU time, the heap frozen as the
server freezes it), where the whole-server proxy (``api_cpu_per_token.py``) swings with how
many steps each streamed event carries.

Prints the median over ``--repeats`` runs of µs of CPU per request-step (= per output token),
with and without the metrics, and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--take-every", type=int, default=4,
                        help="the consumer takes its output every this many steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the engine's --stream-interval (deltas every this many tokens)")
    parser.add_argument("--multiprocess", action="store_true",
                        help="prometheus_client's multiprocess mode (--api-server-count > 1)")
    args = parser.parse_args()
    if args.multiprocess:  # read by prometheus_client when it is first imported
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="octavo-prom-")

    from transformers import AutoTokenizer

    from octavo.engine.output_collector import RequestOutputCollector
    from octavo.engine.output_processor import OutputProcessor, RequestOutputKind
    from octavo.engine.processor import Processor
    from octavo.entrypoints.openai.metrics import PrometheusStatLogger
    from octavo.messages import EngineCoreOutput, SchedulerStats
    from octavo.sampling_params import SamplingParams
    from octavo.testing.tiny_models import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="octavo-tiny-")), "llama")
    tokenizer = AutoTokenizer.from_pretrained(model)

    class _ModelConfig:  # what Processor reads of a ModelConfig
        vocab_size = tokenizer.vocab_size
        max_model_len = 4096
        max_logprobs = 20
        max_n = 128

    processor = Processor(_ModelConfig(), tokenizer, set())
    num_requests, num_steps = args.num_requests, args.num_steps

    def run(metrics: PrometheusStatLogger | None) -> float:
        """µs of CPU per request-step of one run."""
        output_processor = OutputProcessor(tokenizer, stream_interval=args.stream_interval)
        collectors = {}
        child_ids = []
        params = SamplingParams(max_tokens=num_steps, ignore_eos=True)
        for i in range(num_requests):
            processed = processor.process(f"r{i}", {"prompt_token_ids": list(range(5, 21))},
                                          params)
            output_processor.add_request(f"r{i}", processed, RequestOutputKind.DELTA)
            collectors[f"r{i}"] = RequestOutputCollector(merge_deltas=True)
            child_ids.append(processed.core_requests[0].request_id)
        # A different token per request and step, from the low ids (text of every kind).
        steps = [[EngineCoreOutput(request_id=child_id,
                                   new_token_ids=[3 + (step * 31 + j) % 300],
                                   finish_reason="length" if step == num_steps - 1 else None)
                  for j, child_id in enumerate(child_ids)]
                 for step in range(num_steps)]
        stats = SchedulerStats.idle()
        gc.collect()
        gc.freeze()  # as the server does after start-up
        start = time.process_time()
        for step, outputs in enumerate(steps):
            processed_outputs = output_processor.process_outputs(outputs)
            for output in processed_outputs.request_outputs:
                collector = collectors[output.request_id]
                collector.put(output)
                if step % args.take_every == args.take_every - 1 or output.finished:
                    collector.get_nowait()
            if metrics is not None:
                metrics.record(stats, processed_outputs.iteration_stats)
        elapsed = time.process_time() - start
        gc.unfreeze()
        assert not output_processor.has_unfinished_requests(), "a request did not finish"
        return 1e6 * elapsed / (num_requests * num_steps)

    metrics = PrometheusStatLogger("m", multiprocess=args.multiprocess)
    result = {}
    for label, logger in (("without_metrics", None), ("with_metrics", metrics)):
        runs = [run(logger) for _ in range(args.repeats)]
        result[label] = round(statistics.median(runs), 2)
        print(f"{label.replace('_', ' ')}: {result[label]:.2f} us of CPU per request-step "
              f"(runs: {', '.join(f'{r:.2f}' for r in runs)})")
    print(json.dumps({"num_requests": num_requests, "num_steps": num_steps,
                      "take_every": args.take_every, "multiprocess": args.multiprocess,
                      "stream_interval": args.stream_interval,
                      "us_per_request_step": result}))


if __name__ == "__main__":
    main()
