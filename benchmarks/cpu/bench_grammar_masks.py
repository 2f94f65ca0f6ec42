"""Host time per step of structured outputs: the engine core's own ``StructuredOutputManager``
filling the token bitmask of N constrained rows and accepting one token per row, then the two
as one step (``accept_and_bitmask_async`` to its result: the chain a deferred sampling waits
for), on the manager's thread or, with ``--process``, through ``GrammarProcess`` (the manager
in a process of its own: the step's latency includes the round trip).

Each row is constrained to a schema of ``octavo.testing.json_schemas`` (round robin) and walks
it with tokens drawn at random among those its mask allows (as a random-weight model would),
so most rows soon sit inside long strings, where nearly every token is allowed.

    python benchmarks/cpu/bench_grammar_masks.py --tokenizer .bench-assets/smollm2-tokenizer \
        --rows 256 --threads 8 --steps 40 [--process]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a saved Hugging Face tokenizer folder")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None,
                        help="mask threads (engine default if unset; not with --process)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--process", action="store_true",
                        help="through GrammarProcess (the grammars in a process of their own)")
    args = parser.parse_args()

    import torch
    from octavo.sample.sampler import unpack_bitmask
    from octavo.sampling_params import StructuredOutputsParams
    from octavo.structured_output.manager import StructuredOutputManager
    from octavo.structured_output.tokenizer import GrammarTokenizer
    from octavo.testing.json_schemas import SCHEMA_CASES
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    grammar_tokenizer = GrammarTokenizer.from_transformers(tokenizer, {tokenizer.eos_token_id})
    vocab = len(tokenizer)
    if args.process:
        from octavo.structured_output.process import GrammarProcess

        manager = GrammarProcess(lambda: grammar_tokenizer, vocab, max_rows=args.rows)
        threads = "the engine's default"
    else:
        manager = StructuredOutputManager(lambda: grammar_tokenizer, vocab,
                                          num_threads=args.threads)
        threads = manager._num_threads
    start = time.perf_counter()
    ids = [str(i) for i in range(args.rows)]
    for i, request_id in enumerate(ids):
        manager.submit(request_id, StructuredOutputsParams(json=SCHEMA_CASES[i % len(SCHEMA_CASES)].schema))
    while manager.num_compiling:
        manager.wait(1.0)
        manager.take_ready()
    setup_s = time.perf_counter() - start
    rng = random.Random(0)
    fill_ms, accept_ms, step_ms = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        bitmask = manager.bitmask(ids)
        t1 = time.perf_counter()
        words = torch.frombuffer(bytearray(bitmask.data), dtype=torch.int32).view(len(ids), -1)
        allowed = unpack_bitmask(words, vocab)
        picks = []
        for row in range(len(ids)):
            candidates = allowed[row].nonzero().flatten()
            picks.append(int(candidates[rng.randrange(len(candidates))]) if len(candidates)
                         else tokenizer.eos_token_id)
        t2 = time.perf_counter()
        sampled = {request_id: [token] for request_id, token in zip(ids, picks)}
        if step % 2 == 0:  # accept, then fill at the next step's start
            errors = manager.accept_step(sampled)
            t3 = time.perf_counter()
            accept_ms.append(1e3 * (t3 - t2))
        else:  # both as one step, as under async scheduling (its masks thrown away)
            errors = manager.accept_and_bitmask_async(ids, [[token] for token in picks],
                                                      ids).result().errors
            t3 = time.perf_counter()
            step_ms.append(1e3 * (t3 - t2))
        assert not errors, errors
        fill_ms.append(1e3 * (t1 - t0))
    result = {
        "bench": "grammar_masks", "rows": args.rows, "vocab": vocab,
        "threads": threads, "process": args.process, "setup_s": round(setup_s, 2),
        "fill_ms_median": round(statistics.median(fill_ms), 3), "fill_ms_max": round(max(fill_ms), 2),
        "accept_ms_median": round(statistics.median(accept_ms), 3),
        "step_ms_median": round(statistics.median(step_ms), 3),
    }
    print(f"{args.rows} rows, {vocab} tokens, {threads} threads"
          f"{' (grammar process)' if args.process else ''}: fill {result['fill_ms_median']} ms "
          f"(max {result['fill_ms_max']}), accept {result['accept_ms_median']} ms, accept + fill "
          f"as one step {result['step_ms_median']} ms; tokenizer tables + compile {setup_s:.1f} s")
    print(json.dumps(result))
    manager.shutdown()


if __name__ == "__main__":
    main()
