"""``octavo generate``: complete prompts (or chat) from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from octavo.cli.options import add_engine_options
from octavo.engine.arg_utils import EngineArgs

# Exit status after Ctrl-C (128 + SIGINT), once what was generated is printed.
EXIT_INTERRUPTED = 130


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions offline. With no --model, uses the embedded "
        "SmolLM2-135M-Instruct. Example: octavo generate 'The capital of France is' --max-tokens 16. "
        "Ctrl-C prints what was generated so far, then 'interrupted' (exit status 130).",
    )
    parser.add_argument("prompts", nargs="*", metavar="PROMPT",
                        help="prompts (default: read one per line from stdin)")
    parser.add_argument("--chat", action="store_true",
                        help="treat each prompt as a user message and apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="most tokens to generate per completion")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: keep the most likely tokens whose probabilities "
                        "add up to P (1.0 keeps all)")
    parser.add_argument("--top-k", type=int, default=-1,
                        help="keep the K most likely tokens (-1 keeps all)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than P times the most likely one (0 keeps all)")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop string (repeat the flag for several)")
    parser.add_argument("--sampling-seed", type=int, default=None, metavar="S",
                        help="per-request seed: the same seed gives the same tokens whatever "
                        "else runs in the batch (default: none)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt (prompt, completions with text, "
                        "token_ids, finish_reason)")
    add_engine_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octavo import LLM, SamplingParams
    from octavo.entrypoints.llm import interrupted_outputs

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
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                               use_tqdm=len(prompts) > 1)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except KeyboardInterrupt as interrupt:
        outputs = interrupted_outputs(interrupt)
        if outputs is None:
            raise  # not from inside generate: main() reports it
        # Ctrl-C: what finished, and what the others had generated (finish_reason=abort).
        _print_outputs(args, prompts, outputs)
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    _print_outputs(args, prompts, outputs)
    return 0


def _print_outputs(args: argparse.Namespace, prompts: list[str], outputs: list) -> None:
    """Each prompt's completions (interrupted ones only if they produced a token)."""
    for prompt, output in zip(prompts, outputs):
        completions = [c for c in output.outputs if c.finish_reason != "abort" or c.token_ids]
        if not completions:
            continue  # interrupted before it produced anything
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "completions": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in completions
                ],
            }))
            continue
        for completion in completions:
            shown = prompt if not args.chat else f"[user] {prompt}\n[assistant]"
            print(f"{shown}{completion.text}")
            print(f"--- finish_reason={completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens", file=sys.stderr)
