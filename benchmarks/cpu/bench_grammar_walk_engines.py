"""Per-step mask time of llguidance and xgrammar on random walks, by thread count.

``bench_grammar_masks.py`` times Octavo's own manager (llguidance); this script puts the two
grammar engines side by side on the workload that made structured outputs slow on the H100
host (docs/benchmarks.md): N rows, each constrained to a schema of
``octavo.testing.json_schemas`` (round robin), walking it with tokens drawn at random among
those its mask allows (as a random-weight model does: most rows soon sit inside long
strings). Each engine walks with its own masks from the same seed; a row that ends is left
out of later fills. Compact JSON (no free whitespace) in both, or with ``--any-whitespace``
whitespace allowed between tokens (the default of ``response_format`` and of
``octavo bench throughput --structured json``).

    python benchmarks/cpu/bench_grammar_walk_engines.py --tokenizer .bench-assets/smollm2-tokenizer \
        --rows 256 --threads 1,4,8 --steps 30
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import numpy as np


def allowed_ids(words: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, threads: int, any_whitespace: bool) -> None:
        import llguidance
        import llguidance.hf
        from octavo.sampling_params import StructuredOutputsParams
        from octavo.structured_output.grammar import grammar_text

        self.llg = llguidance
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                 eos_token=tokenizer.eos_token_id)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.grammar_of = lambda schema: grammar_text(
            StructuredOutputsParams(json=schema, disable_any_whitespace=not any_whitespace))

    def matchers(self, schemas: list[dict], rows: int) -> list[Any]:
        compiled = [self.llg.LLMatcher(self.info, self.grammar_of(s), log_level=0)
                    for s in schemas]
        return [compiled[i % len(compiled)].deep_copy() for i in range(rows)]

    def fill(self, matchers: list[Any], live: list[int], out: np.ndarray) -> None:
        import llguidance.numpy as llg_numpy

        llg_numpy.fill_next_token_bitmask_par(self.executor, [(matchers[i], i) for i in live], out)

    def accept(self, matcher: Any, token: int) -> None:
        matcher.consume_token(token)

    def ended(self, matcher: Any) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, threads: int, any_whitespace: bool) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.any_whitespace = any_whitespace

    def matchers(self, schemas: list[dict], rows: int) -> list[Any]:
        compiled = [self.compiler.compile_json_schema(json.dumps(s),
                                                  any_whitespace=self.any_whitespace)
                    for s in schemas]
        return [self.xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(rows)]

    def fill(self, matchers: list[Any], live: list[int], out: np.ndarray) -> None:
        import torch

        self.batch.batch_fill_next_token_bitmask([matchers[i] for i in live],
                                                 torch.from_numpy(out), live)

    def accept(self, matcher: Any, token: int) -> None:
        matcher.accept_token(token)

    def ended(self, matcher: Any) -> bool:
        return matcher.is_terminated()


def walk(engine: Any, schemas: list[dict], rows: int, steps: int, vocab: int,
         eos: int) -> dict[str, float]:
    matchers = engine.matchers(schemas, rows)
    words = (vocab + 31) // 32
    out = np.zeros((rows, words), dtype=np.int32)
    rng = random.Random(0)
    fill_ms, accept_ms = [], []
    for _ in range(steps):
        live = [i for i, m in enumerate(matchers) if not engine.ended(m)]
        if not live:
            break
        t0 = time.perf_counter()
        engine.fill(matchers, live, out)
        t1 = time.perf_counter()
        picks = []
        for i in live:
            candidates = allowed_ids(out[i], vocab)
            picks.append(int(candidates[rng.randrange(len(candidates))]) if len(candidates)
                         else eos)
        t2 = time.perf_counter()
        for i, token in zip(live, picks, strict=True):
            engine.accept(matchers[i], token)
        t3 = time.perf_counter()
        fill_ms.append(1e3 * (t1 - t0))
        accept_ms.append(1e3 * (t3 - t2))
    return {"fill_ms_median": round(statistics.median(fill_ms), 2),
            "fill_ms_max": round(max(fill_ms), 2),
            "accept_ms_median": round(statistics.median(accept_ms), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a saved Hugging Face tokenizer folder")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", default="1,4,8", help="comma-separated thread counts")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--any-whitespace", action="store_true",
                        help="allow whitespace between JSON tokens")
    args = parser.parse_args()

    from octavo.testing.json_schemas import SCHEMA_CASES
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    schemas = [case.schema for case in SCHEMA_CASES]
    for threads in (int(t) for t in args.threads.split(",")):
        for engine_cls in (Llguidance, Xgrammar):
            engine = engine_cls(tokenizer, vocab, threads, args.any_whitespace)
            result = {"bench": "grammar_walk", "engine": engine.name, "rows": args.rows,
                      "threads": threads, "vocab": vocab, "any_whitespace": args.any_whitespace,
                      **walk(engine, schemas, args.rows, args.steps, vocab,
                             tokenizer.eos_token_id)}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
