"""Save a random-weight model of a real shape, loadable by Octavo's normal loader.

    python benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out /tmp/qwen05b

The tokenizer is a word-level one with one token per id ("t0", "t1", ...), so every id of
the model's vocabulary detokenizes (benchmarks use random token-id prompts).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
    # vocab 151936, tied embeddings.
    "qwen2.5-0.5b": dict(
        arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
}


def make_word_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1", unk_token="t0")
    fast.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(SHAPES[args.shape])
    arch = shape.pop("arch")
    assert arch == "qwen2"
    config = Qwen2Config(**shape, bos_token_id=1, eos_token_id=1)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(args.out, safe_serialization=True)
    make_word_tokenizer(config.vocab_size, args.out)
    print(f"saved {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) to {args.out}")


if __name__ == "__main__":
    main()
