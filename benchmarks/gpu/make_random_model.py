"""Save a random-weight model of a real shape, loadable by Octavo's normal loader.

    python benchmarks/gpu/make_random_model.py --shape qwen2.5-0.5b --out /tmp/qwen05b
    python benchmarks/gpu/make_random_model.py --shape qwen3-30b-a3b --config-only --out /tmp/q3moe

``--config-only`` writes the config and tokenizer without weights: run it with
``--load-format dummy`` (random weights made on the device; Qwen3-30B-A3B's 61 GB of bf16
weights need not be written to disk and read back). ``--quant-config gptq`` adds a 4-bit
``quantization_config`` (``--shape llama3-8b --config-only --quant-config gptq``): the dummy
weights are then packed int4.

The tokenizer is a word-level one with one token per id ("t0", "t1", ...), so every id of
the model's vocabulary detokenizes (benchmarks use random token-id prompts). ``--tokenizer DIR``
copies a real tokenizer instead (one that can spell JSON, for ``--structured json``) and sizes
the vocabulary to it:

    python benchmarks/gpu/export_tokenizer.py --out .bench-assets/smollm2-tokenizer   # here
    python benchmarks/gpu/make_random_model.py --tokenizer .bench-assets/smollm2-tokenizer \
        --out /tmp/qwen05b-smollm2-vocab
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
    # Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads, 4 KV heads of 128, 128 experts of
    # intermediate 768 with top-8 renormalised routing in every layer, vocab 151936, untied;
    # 30.5B parameters, 3.3B active per token.
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
}
# Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256,
# untied embeddings; 8.0B parameters.
SHAPES["llama3-8b"] = dict(
    arch="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
    tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
# Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads of 64, intermediate 8192, the
# Llama-3 vocabulary (128256), tied embeddings; 1.2B parameters (the draft of llama3-8b in
# speculative decoding; context kept at 8192 like llama3-8b's, no long-context rope scaling).
SHAPES["llama3.2-1b"] = dict(
    arch="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
    tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3_moe": "Qwen3MoeConfig", "llama": "LlamaConfig"}
# quantization_config of --quant-config (what GPTQ / AutoAWQ write for 4-bit, group 128): with
# --config-only and --load-format dummy the random weights are made packed int4.
QUANT_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
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


def save_tokenizer(tokenizer, vocab_size: int, out: Path) -> None:
    if tokenizer is None:
        make_word_tokenizer(vocab_size, out)
    else:
        tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a saved Hugging Face tokenizer folder to use (vocabulary sized to it)")
    parser.add_argument("--config-only", action="store_true",
                        help="write config.json and the tokenizer only (use --load-format dummy)")
    parser.add_argument("--quant-config", choices=sorted(QUANT_CONFIGS), default=None,
                        help="with --config-only: add this quantization_config (4-bit, group 128)")
    args = parser.parse_args()
    if args.quant_config and not args.config_only:
        parser.error("--quant-config needs --config-only (the weights come from --load-format "
                     "dummy)")
    import transformers
    from transformers import AutoModelForCausalLM

    shape = dict(SHAPES[args.shape])
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        shape["vocab_size"] = -(-len(tokenizer) // 64) * 64
    config_cls = getattr(transformers, CONFIG_CLASSES[shape.pop("arch")])
    special = ({"bos_token_id": 1, "eos_token_id": 1} if tokenizer is None else
               {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id})
    config = config_cls(**shape, **special)
    dtype = getattr(torch, args.dtype)
    if args.config_only:
        config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
        config.dtype = dtype
        if args.quant_config:
            config.quantization_config = QUANT_CONFIGS[args.quant_config]
        config.save_pretrained(args.out)
        save_tokenizer(tokenizer, config.vocab_size, args.out)
        print(f"saved the {args.shape} config and tokenizer (no weights) to {args.out}")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(tokenizer, config.vocab_size, args.out)
    print(f"saved {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) to {args.out}")


if __name__ == "__main__":
    main()
