"""Tiny random-weight models of real architectures, saved the way a user would have them.

Each model is made with ``transformers`` (config -> model -> ``save_pretrained``) into a folder
with a small byte-level BPE tokenizer trained with ``tokenizers``, so every test goes through the
real loading path. Everything is deterministic (fixed seeds, fixed corpus). Nothing is
downloaded.

Used by Octavo's own tests (``tests/helpers/tiny.py`` re-exports this module) and by the
backend conformance suite (``octavo.testing.conformance``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 384

# A corpus with ASCII, accents, CJK and emoji so byte-level merges and multi-byte characters
# both occur.
_CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Once upon a time there was a small model that learned to count: one, two, three.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber d\u00e9j\u00e0 vu.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u53e5\u5b50\u3002 \U0001F600 \U0001F680 \u2764\ufe0f",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Hello world! hello World? HELLO, world; 12345 67890",
] * 20

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                 "gemma2", "gemma3", "phi3")


def train_tokenizer(folder: Path) -> None:
    """Train a byte-level BPE tokenizer and save it (with a chat template) into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)


def tiny_config(arch: str, **overrides):
    """The ``transformers`` config of a tiny ``arch`` model (hidden 64, 2 layers, 4/2 heads).

    ``overrides`` replace config fields (e.g. ``head_dim=64``, ``num_hidden_layers=1``).
    """
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    overrides = dict(overrides)
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    # Overrides go through the constructor so derived fields (e.g. head_dim) follow them.
    for key in list(overrides):
        if key in common:
            common[key] = overrides.pop(key)
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "llama3-rope":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    # Mixtures of experts: 8 experts, top 2 (Qwen3-MoE top 4). Mixtral's experts are of
    # intermediate_size; Qwen's of moe_intermediate_size, intermediate_size serving the dense
    # layers (mlp_only_layers). Sizes and tying chosen so greedy output is not degenerate.
    elif arch == "mixtral":
        cfg = MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                            sliding_window=None)
    elif arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=32,
                             norm_topk_prob=False, tie_word_embeddings=False)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=4,
                             moe_intermediate_size=32, norm_topk_prob=True,
                             tie_word_embeddings=False)
    elif arch == "mistral-swa":  # Mistral 7B v0.1's shape family: every layer windowed
        cfg = MistralConfig(**common, sliding_window=8)
    elif arch == "gemma2":
        # Local/global layers alternate; the window and both soft caps are small enough to
        # change the outputs of a tiny random model (the real ones: 4096, 50 and 30).
        cfg = Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=2.0, final_logit_softcapping=4.0,
            # Untied: a tied random tiny model repeats one token under greedy decoding (the
            # tied head under the embedding scale has a test of its own).
            tie_word_embeddings=False,
        )
    elif arch == "gemma3":
        # Two local layers then a global one (the real models: five then one); local rope base
        # 10k, global 1M with linear scaling (Gemma 3 4B's).
        cfg = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=8, tie_word_embeddings=False,  # untied as Gemma 2's above
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0},
            },
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif arch == "phi3":
        # Phi-4-mini's shape family: longrope with a partial rotary factor (untied here: tied,
        # the tiny random model's greedy output is degenerate).
        # original_max_position_embeddings is below every test sequence, so transformers uses
        # the long factors throughout, as Octavo does for a context longer than it.
        # One factor per rotated pair: 6 at the default head_dim 16; wider heads (the GPU
        # tests' 64) get factors spread over the same range.
        pairs = int(common["hidden_size"] // common["num_attention_heads"] * 0.75) // 2
        short, long = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]
        if pairs != len(short):
            short = [1.0 + 1.5 * (i / (pairs - 1)) ** 2 for i in range(pairs)]
            long = [1.0 + 8.0 * (i / (pairs - 1)) ** 2 for i in range(pairs)]
        cfg = Phi3Config(
            **common, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": short, "long_factor": long,
                "original_max_position_embeddings": 4,
            },
            original_max_position_embeddings=4,
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_tiny_model(
    folder: Path, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0,
    max_shard_size: str | None = None, **overrides,
) -> Path:
    """Save a random-weight ``arch`` model plus tokenizer into ``folder`` and return it.

    ``arch`` is one of ``ARCHITECTURES``, ``"llama3-rope"`` or ``"mistral-swa"``; ``overrides`` go to
    ``tiny_config``. The weights are saved in ``dtype`` as safetensors.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Larger-than-init weights make the logits spread out, so greedy ties are unlikely.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    train_tokenizer(folder)
    return folder


def write_generation_config(folder: Path, **fields) -> None:
    """Write ``generation_config.json`` with ``fields`` into a model folder."""
    (Path(folder) / "generation_config.json").write_text(json.dumps(fields))
