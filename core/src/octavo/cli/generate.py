"""``octavo generate``: complete prompts (or chat) from the command line."""

from __future__ import annotations

import argparse
from dataclasses import asdict
import json
import sys

from octavo.engine.arg_utils import EngineArgs


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions offline. With no --model, uses the embedded "
        "SmolLM2-135M-Instruct. Example: octavo generate 'The capital of France is' --max-tokens 16",
    )
    parser.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message and apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octavo import LLM, SamplingParams

    if not args.prompts and sys.stdin.isatty():
        # Reading a terminal would wait silently for input the user does not know is expected.
        raise ValueError("no prompt given (pass prompts as arguments or pipe them on stdin)")
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt given (pass prompts as arguments or on stdin)")
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, max_tokens=args.max_tokens, stop=args.stop, seed=args.sampling_seed,
    )
    llm = LLM(**asdict(EngineArgs.from_cli_args(args)))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=len(prompts) > 1)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, output in zip(prompts, outputs):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "completions": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in output.outputs
                ],
            }))
            continue
        for completion in output.outputs:
            shown = prompt if not args.chat else f"[user] {prompt}\n[assistant]"
            print(f"{shown}{completion.text}")
            print(f"--- finish_reason={completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens", file=sys.stderr)
    return 0
