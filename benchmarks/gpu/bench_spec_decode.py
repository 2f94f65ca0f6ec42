"""Speculative decoding speed-up at batch 1 on a repetitive prompt (any backend): ngram, a
draft model with ``--draft-model``, or an EAGLE-3 head with ``--eagle3-head``.

    python benchmarks/gpu/bench_spec_decode.py --model /tmp/llama3-8b-config --load-format dummy \
        --device cuda --num-speculative-tokens 4
    python benchmarks/gpu/bench_spec_decode.py --model /tmp/llama3-8b-config --load-format dummy \
        --device cuda --num-speculative-tokens 4 --draft-model /tmp/llama3.2-1b-config
    python benchmarks/gpu/bench_spec_decode.py --device cpu   # the default model (SmolLM2 GGUF)

With ``--draft-model`` the draft loads with the target's ``--load-format`` (dummy: random
weights too, so acceptance is near zero and the run measures the draft's cost; a draft that is
the target itself accepts every draft and measures the machinery at full acceptance). So does
an ``--eagle3-head`` folder (with dummy weights only its config.json is read: the run measures
what the head and the target's auxiliary hidden states cost).

The prompt is a block of random token ids repeated (``--block-len`` x ``--repeats``), or with
``--text`` a text prompt asking to repeat a passage (for a real model). The same greedy request
runs without and with ``--speculative-config`` (ngram): the script reports whether the outputs
are identical (and where they first differ: a backend whose one-token and several-token paths
round differently, e.g. the CPU's GGUF kernels, may flip a near-tie), and prints decode speed, the speed-up, the draft acceptance rate and the mean
acceptance length, then one JSON line. With random weights acceptance comes only from the
model's own loops, so read the speed-up together with the acceptance rate measured beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

TEXT = ("Repeat the following passage exactly, three times.\n\nThe quick brown fox jumps over "
        "the lazy dog. A journey of a thousand miles begins with a single step. All that "
        "glitters is not gold.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--block-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--text", action="store_true", help="a text prompt instead of token ids")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=2048)
    parser.add_argument("--draft-model", default=None,
                        help="folder of a draft model (method draft_model) instead of ngram")
    parser.add_argument("--eagle3-head", default=None,
                        help="folder of an EAGLE-3 head (method eagle3) instead of ngram")
    args = parser.parse_args()

    from octavo import LLM, SamplingParams

    engine_kwargs = dict(device=args.device, load_format=args.load_format, dtype=args.dtype,
                         num_gpu_blocks_override=args.num_gpu_blocks_override,
                         enable_prefix_caching=False)
    if args.model is not None:
        engine_kwargs["model"] = args.model
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}
    method = "ngram"
    if args.draft_model is not None or args.eagle3_head is not None:
        method = "draft_model" if args.draft_model is not None else "eagle3"
        spec = {"method": method, "model": args.draft_model or args.eagle3_head,
                "num_speculative_tokens": args.num_speculative_tokens}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results = {}
    outputs = {}
    for name, extra in (("baseline", {}), (method, {"speculative_config": spec})):
        llm = LLM(**engine_kwargs, **extra)
        vocab = llm.llm_engine.config.model_config.vocab_size
        if args.text:
            prompt = TEXT
        else:
            rng = random.Random(0)
            block = [rng.randrange(100, vocab - 100) for _ in range(args.block_len)]
            prompt = {"prompt_token_ids": block * args.repeats}
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        before = llm.llm_engine.stats()
        times, ttfts = [], []
        for _ in range(args.iters):
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            times.append(time.perf_counter() - start)
            metrics = out.metrics
            if metrics is not None and metrics.first_token_time is not None:
                ttfts.append(metrics.first_token_time - metrics.arrival_time)
        stats = llm.llm_engine.stats()
        outputs[name] = list(out.outputs[0].token_ids)
        best = min(times)
        ttft = min(ttfts) if ttfts else 0.0
        result = {"seconds": round(best, 4),
                  "decode_tokens_per_s": round((args.output_len - 1) / max(best - ttft, 1e-9), 2)}
        drafts = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
        if drafts:
            drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (stats.spec_decode_num_accepted_tokens
                        - before.spec_decode_num_accepted_tokens)
            result.update(draft_acceptance_rate=round(accepted / drafted, 4),
                          mean_acceptance_length=round(1 + accepted / drafts, 3))
        results[name] = result
        print(f"{name:9s}: {result}")
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the second engine sizes nothing from free memory, but
            # the first one's weights must be gone before the second loads its own
    same = outputs["baseline"] == outputs[method]
    first_difference = next((i for i, (a, b) in enumerate(zip(outputs["baseline"],
                                                              outputs[method])) if a != b), None)
    speedup = results["baseline"]["seconds"] / results[method]["seconds"]
    print(f"outputs identical: {same} (first difference at {first_difference}); speed-up {speedup:.2f}x at draft acceptance rate "
          f"{results[method].get('draft_acceptance_rate', 0):.1%}")
    print(json.dumps({"bench": f"spec_decode_{method}", "model": args.model,
                      "draft_model": args.draft_model or args.eagle3_head,
                      "device": args.device,
                      "k": args.num_speculative_tokens, "output_len": args.output_len,
                      "identical": same, "first_difference": first_difference, "speedup": round(speedup, 3), **{
                          f"{k}_{m}": v for k, r in results.items() for m, v in r.items()}}))


if __name__ == "__main__":
    main()
