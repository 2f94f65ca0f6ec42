"""Save the default model's tokenizer (SmolLM2's, read from its GGUF file) as a Hugging Face
tokenizer folder, small enough to carry to the GPU machine, where ``make_random_model.py
--tokenizer`` builds a random model that can spell JSON with it.

    python benchmarks/gpu/export_tokenizer.py --out .bench-assets/smollm2-tokenizer
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from octavo.engine.arg_utils import EngineArgs
    from octavo.transformers_utils.tokenizer import load_tokenizer

    config = EngineArgs(device="cpu").create_engine_config()
    tokenizer = load_tokenizer(config.model_config)
    tokenizer.save_pretrained(args.out)
    print(f"saved {type(tokenizer).__name__} ({len(tokenizer)} tokens) to {args.out}")


if __name__ == "__main__":
    main()
