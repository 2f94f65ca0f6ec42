"""xgrammar vs llguidance on the default model's tokenizer: which grammar engine Octavo uses.

For each engine, on SmolLM2's tokenizer (49,152 tokens):

- coverage: which of ``octavo.testing.json_schemas`` compile, and whether each schema's valid
  instance, tokenized as the model would write it, is accepted token by token;
- compile time per schema, cold (a fresh compiler, nothing cached);
- mask time per step: one bitmask for each of 64 requests (the schemas round-robin), filled
  for the whole batch in one call with the engine's own thread pool, while every request walks
  its instance token by token -- the host work the engine core does per decode step;
- the error message for an invalid regex and an invalid schema.

    python benchmarks/cpu/bench_grammar_engines.py [--batch 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from octavo.testing.json_schemas import SCHEMA_CASES


def load_smollm2_tokenizer() -> Any:
    from octavo.model_executor.loader.gguf_file import read_gguf
    from octavo.model_executor.loader.gguf_hf import gguf_hf_config, gguf_hf_tokenizer
    from octavo.model_executor.model_files import resolve_model_path

    _, _, gguf_path = resolve_model_path(None)
    gguf = read_gguf(gguf_path)
    return gguf_hf_tokenizer(gguf, gguf_hf_config(gguf))


def instance_tokens(tokenizer: Any, instance: Any) -> list[int]:
    return tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads,
                                            cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.info.vocab_size)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def errors(self) -> dict[str, str]:
        out = {}
        for what, call in (("regex", lambda: self.xgr.Grammar.from_regex("(a")),
                           ("schema", lambda: self.xgr.Grammar.from_json_schema(
                               '{"type": "object", "properties": 3}'))):
            try:
                call()
                out[what] = "(accepted)"
            except Exception as exc:  # noqa: BLE001 - reporting the message is the point
                out[what] = str(exc).splitlines()[0][:160]
        return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.vocab = len(tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llg_torch.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    def errors(self) -> dict[str, str]:
        out = {}
        for what, grammar in (
            ("regex", self.llg.LLMatcher.grammar_from_regex("(a")),
            ("schema", self.llg.LLMatcher.grammar_from_json_schema(
                '{"type": "object", "properties": 3}')),
        ):
            message = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
            out[what] = message.splitlines()[0][:160] if message else "(accepted)"
        return out


def run(engine: Any, tokenizer: Any, batch: int) -> dict[str, Any]:
    compile_ms: list[float] = []
    compiled: dict[str, Any] = {}
    failures: list[str] = []
    for case in SCHEMA_CASES:
        start = time.perf_counter()
        try:
            compiled[case.name] = engine.compile(case.schema)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{case.name}: compile: {str(exc).splitlines()[0][:100]}")
            continue
        compile_ms.append((time.perf_counter() - start) * 1e3)
    # One instance per request, schemas round-robin; each request walks its instance.
    names = [c.name for c in SCHEMA_CASES if c.name in compiled]
    cases = {c.name: c for c in SCHEMA_CASES}
    walks = [(names[i % len(names)]) for i in range(batch)]
    tokens = [instance_tokens(tokenizer, cases[n].instance) for n in walks]
    matchers = [engine.matcher(compiled[n]) for n in walks]
    bitmask = engine.bitmask(batch)
    step_ms: list[float] = []
    rejected: set[str] = set()
    for step in range(max(len(t) for t in tokens)):
        start = time.perf_counter()
        engine.fill(matchers, bitmask)
        step_ms.append((time.perf_counter() - start) * 1e3)
        for i, (matcher, walk) in enumerate(zip(matchers, tokens)):
            if step < len(walk):
                token = walk[step]
                allowed = bool((bitmask[i, token // 32] >> (token % 32)) & 1)
                if not allowed or not engine.accept(matcher, token):
                    rejected.add(walks[i])
                    tokens[i] = walk[:step]  # stop walking this one
    failures += [f"{name}: the valid instance was rejected" for name in sorted(rejected)]
    return {
        "engine": engine.name,
        "schemas_ok": len(SCHEMA_CASES) - len({f.split(':')[0] for f in failures}),
        "schemas": len(SCHEMA_CASES),
        "compile_ms_median": round(statistics.median(compile_ms), 2) if compile_ms else None,
        "compile_ms_max": round(max(compile_ms), 2) if compile_ms else None,
        "mask_ms_per_step_median": round(statistics.median(step_ms), 3),
        "mask_ms_per_step_p90": round(sorted(step_ms)[int(0.9 * len(step_ms))], 3),
        "batch": batch,
        "failures": failures,
        "errors": engine.errors(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_smollm2_tokenizer()
    for engine_class in (XGrammar, LLGuidance):
        start = time.perf_counter()
        engine = engine_class(tokenizer, args.threads)
        setup_s = time.perf_counter() - start
        result = run(engine, tokenizer, args.batch)
        result["tokenizer_setup_s"] = round(setup_s, 2)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
