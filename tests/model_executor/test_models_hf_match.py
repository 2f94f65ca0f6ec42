"""Our model implementations against Hugging Face transformers on the same tiny checkpoints.

For every architecture (fp32): full-prompt logits, greedy decoding token by token through the
paged KV cache, and one flat batch mixing a prefill, a chunk after a cached prefix and a decode.
Block size 4 and a reversed block table make sequences cross non-contiguous blocks.

The mixtures of experts run in variants: top-k with and without renormalisation
(``norm_topk_prob``), dense layers among sparse ones (``mlp_only_layers``,
``decoder_sparse_step``), and Qwen2-MoE's gated shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import ReferenceAttentionBackend
from octavo.model_executor.models import builtin_registry
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from tests.helpers.tiny import make_tiny_model

# Variants of an architecture: name -> (tiny architecture, tiny_config overrides).
VARIANTS = {
    "qwen3_moe-no-renorm-dense-layer": ("qwen3_moe", {"norm_topk_prob": False,
                                                      "mlp_only_layers": [0]}),
    "qwen2_moe-renorm-sparse-step-2": ("qwen2_moe", {"norm_topk_prob": True,
                                                     "decoder_sparse_step": 2}),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", *VARIANTS)
ARCHS = ("llama", "llama3-rope", "mistral", "mistral-swa", "qwen2", "qwen3", "gemma2", "gemma3",
         "phi3", *MOE_ARCHS)
BLOCK_SIZE = 4
NUM_BLOCKS = 32
PROMPT = [1, 17, 250, 33, 99, 7, 301, 45, 12, 200, 5]


@dataclass
class Loaded:
    arch: str
    folder: Path
    hf: torch.nn.Module
    ours: torch.nn.Module


def build_ours(folder: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(folder)
    model_cls = builtin_registry().resolve(config.architectures)
    model = model_cls(config, ReferenceAttentionBackend())
    model.load_weights(load_file(str(folder / "model.safetensors")).items())
    return model.eval()


_LOADED: dict[str, Loaded] = {}


def load(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """Make (once per test session) the tiny ``arch`` checkpoint and both models on it."""
    if arch in _LOADED:
        return _LOADED[arch]
    tiny_arch, overrides = VARIANTS.get(arch, (arch, {}))
    folder = make_tiny_model(tmp_path_factory.mktemp(arch), tiny_arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Norm weights are all ones after init; make them matter (q_norm/k_norm included), re-save.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    hf.save_pretrained(folder, safe_serialization=True)
    _LOADED[arch] = Loaded(arch, folder, hf, build_ours(folder))
    return _LOADED[arch]


@pytest.fixture(params=ARCHS)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return load(request.param, tmp_path_factory)


def new_kv_caches(model: torch.nn.Module) -> list[torch.Tensor]:
    attn = next(iter(model.model.layers.values())).self_attn
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    return [torch.zeros(shape) for _ in model.model.layers]


def make_step(
    seqs: list[tuple[list[int], list[int], int]],
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One flat step from ``(block_table, token_ids_so_far, num_new)`` per sequence.

    The last ``num_new`` of each sequence's tokens are computed; the rest are already cached.
    """
    input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for table, tokens, num_new in seqs:
        for pos in range(len(tokens) - num_new, len(tokens)):
            input_ids.append(tokens[pos])
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + num_new)
        seq_lens.append(len(tokens))
    metadata = AttentionMetadata.from_lists(slots, starts, seq_lens, [t for t, _, _ in seqs])
    return torch.tensor(input_ids), torch.tensor(positions), metadata


def run(model, kv_caches, seqs) -> torch.Tensor:  # [num_tokens, vocab_size]
    input_ids, positions, metadata = make_step(seqs)
    with torch.inference_mode():
        hidden = model(input_ids, positions, kv_caches, metadata)  # [num_tokens, hidden_size]
        return model.compute_logits(hidden)


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:  # [len, vocab_size]
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def test_prompt_logits_match_hf(loaded: Loaded) -> None:
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 4, -1))  # reversed, crosses blocks
    logits = run(loaded.ours, new_kv_caches(loaded.ours), [(table, PROMPT, len(PROMPT))])
    assert logits.dtype == torch.float32
    assert logits.shape == (len(PROMPT), loaded.hf.config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(loaded.hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_hf_generate(loaded: Loaded) -> None:
    num_new = 20
    loaded.hf.generation_config.eos_token_id = None  # else generate falls back to the model's
    generation = GenerationConfig(
        max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        expected = loaded.hf.generate(
            torch.tensor([PROMPT]), generation_config=generation
        )[0, len(PROMPT):].tolist()
    assert len(expected) == num_new

    kv_caches = new_kv_caches(loaded.ours)
    table = list(range(NUM_BLOCKS - 1, -1, -1))
    tokens = list(PROMPT)
    num_computed = 0
    for _ in range(num_new):
        logits = run(loaded.ours, kv_caches, [(table, tokens, len(tokens) - num_computed)])
        num_computed = len(tokens)
        tokens.append(int(logits[-1].argmax()))
    assert tokens[len(PROMPT):] == expected
    assert len(set(expected)) > 3, "degenerate greedy output would make this test weak"


def test_mixed_batch_matches_single_sequences(loaded: Loaded) -> None:
    ours = loaded.ours
    seq_a = PROMPT[:5]  # whole prompt this step
    seq_b = PROMPT + [3, 8, 13]  # 6 cached, then a chunk of 8
    seq_c = PROMPT[:9] + [42]  # 9 cached, one decode token
    table_a, table_b, table_c = [9, 3], [30, 2, 17, 11], [5, 28, 20]
    kv_caches = new_kv_caches(ours)
    run(ours, kv_caches, [(table_b, seq_b[:6], 6), (table_c, seq_c[:9], 9)])  # fill prefixes
    mixed = run(ours, kv_caches, [(table_a, seq_a, 5), (table_b, seq_b, 8), (table_c, seq_c, 1)])
    assert mixed.shape[0] == 5 + 8 + 1

    alone = [
        run(ours, new_kv_caches(ours), [([0, 1, 2, 3], seq, len(seq))])[-num_new:]
        for seq, num_new in ((seq_a, 5), (seq_b, 8), (seq_c, 1))
    ]
    torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    reference = torch.cat([hf_logits(loaded.hf, seq_a), hf_logits(loaded.hf, seq_b)[-8:],
                           hf_logits(loaded.hf, seq_c)[-1:]])
    torch.testing.assert_close(mixed, reference, atol=1e-4, rtol=1e-4)


def test_load_reports_missing_and_unknown_weights(tmp_path_factory) -> None:
    loaded = load("llama", tmp_path_factory)
    config = AutoConfig.from_pretrained(loaded.folder)
    model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    weights = load_file(str(loaded.folder / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    del weights["model.norm.weight"]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as error:
        model.load_weights(weights.items())
    message = str(error.value)
    assert "model.layers.1.self_attn.qkv_proj.weight[k_proj]" in message
    assert "model.norm.weight" in message
    assert "model.layers.0.mlp.extra.weight" in message


def test_load_reports_missing_expert_weights(tmp_path_factory) -> None:
    loaded = load("mixtral", tmp_path_factory)
    config = AutoConfig.from_pretrained(loaded.folder)
    model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    weights = load_file(str(loaded.folder / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    weights["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = torch.zeros(1)  # 8 experts
    with pytest.raises(ValueError) as error:
        model.load_weights(weights.items())
    message = str(error.value)
    assert "model.layers.1.mlp.experts.w13_weight[5.w3]" in message
    assert "model.layers.0.mlp.experts.8.w1.weight" in message


def test_moe_layers_are_built_as_configured(tmp_path_factory) -> None:
    """Dense layers where the config says so; the shared expert only in Qwen2-MoE."""
    from octavo.model_executor.layers.fused_moe import FusedMoE
    from octavo.model_executor.models.llama import LlamaMLP

    def mlps(arch):
        return [type(layer.mlp.experts if hasattr(layer.mlp, "experts") else layer.mlp)
                for layer in load(arch, tmp_path_factory).ours.model.layers.values()]

    assert mlps("qwen3_moe-no-renorm-dense-layer") == [LlamaMLP, FusedMoE]
    assert mlps("qwen2_moe-renorm-sparse-step-2") == [LlamaMLP, FusedMoE]
    assert mlps("mixtral") == [FusedMoE, FusedMoE]
    qwen2 = load("qwen2_moe", tmp_path_factory).ours.model.layers["0"].mlp
    assert qwen2.shared_expert is not None and qwen2.shared_expert_gate is not None
    assert load("qwen3_moe", tmp_path_factory).ours.model.layers["0"].mlp.shared_expert is None


# Not the mixtures of experts: transformers 5 holds their experts fused in memory
# (``experts.gate_up_proj``), a layout checkpoints do not use (they store one tensor per expert,
# which is what Octavo loads), so an HF state dict is no checkpoint for them.
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MOE_ARCHS])
def test_tied_lm_head_and_rope_buffers_are_ignored(arch: str, tmp_path_factory) -> None:
    """An HF state dict (tied ``lm_head.weight`` included) plus an ``inv_freq`` loads cleanly."""
    loaded = load(arch, tmp_path_factory)
    config = AutoConfig.from_pretrained(loaded.folder)
    model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    state = dict(loaded.hf.state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    model.load_weights(state.items())
    # Tied: the LM head is the embedding itself (one weight), else a weight of its own.
    assert (model.lm_head is model.model.embed_tokens) == bool(config.tie_word_embeddings)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_bfloat16_construction_casts_weights(arch: str, tmp_path_factory) -> None:
    loaded = load(arch, tmp_path_factory)
    config = AutoConfig.from_pretrained(loaded.folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(load_file(str(loaded.folder / "model.safetensors")).items())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    kv_caches = [c.to(torch.bfloat16) for c in new_kv_caches(model)]
    logits = run(model, kv_caches, [([0, 1, 2], PROMPT, len(PROMPT))])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(loaded.hf, PROMPT), atol=0.1, rtol=0.05)


def test_sliding_window_is_exposed(tmp_path: Path) -> None:
    from tests.helpers.tiny import _config

    mistral = _config("mistral", sliding_window=4096)
    qwen_off = _config("qwen2", sliding_window=1024, use_sliding_window=False)
    registry = builtin_registry()
    backend = ReferenceAttentionBackend()
    assert registry.resolve(["MistralForCausalLM"])(mistral, backend).sliding_window == 4096
    assert registry.resolve(["Qwen2ForCausalLM"])(qwen_off, backend).sliding_window is None
    assert registry.resolve(["LlamaForCausalLM"])(_config("llama"), backend).sliding_window is None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_tied_head_reads_the_unscaled_embedding(arch: str, tmp_path: Path) -> None:
    """Tied (as the real checkpoints are): the LM head is the embedding weight, not the
    ``sqrt(hidden)``-scaled embedding output."""
    folder = make_tiny_model(tmp_path, arch, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = build_ours(folder)
    assert ours.lm_head is ours.model.embed_tokens
    logits = run(ours, new_kv_caches(ours), [([0, 1, 2], PROMPT, len(PROMPT))])
    torch.testing.assert_close(logits, hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_gemma_soft_caps_and_scale_are_read_from_the_config(tmp_path_factory) -> None:
    """Gemma 2 caps attention scores and logits; Gemma 3 only logits (when set); both scale
    scores by ``query_pre_attn_scalar``; local and global layers alternate."""
    gemma2 = load("gemma2", tmp_path_factory).ours
    gemma3 = load("gemma3", tmp_path_factory).ours
    attn2 = [layer.self_attn.attn for layer in gemma2.model.layers.values()]
    attn3 = [layer.self_attn.attn for layer in gemma3.model.layers.values()]
    assert [a.logits_soft_cap for a in attn2] == [2.0, 2.0]
    assert [a.logits_soft_cap for a in attn3] == [None, None, None]
    assert [a.sliding_window for a in attn2] == [8, None]
    assert [a.sliding_window for a in attn3] == [8, 8, None]
    assert {a.scale for a in attn2 + attn3} == {24**-0.5}
    assert gemma2.final_logit_softcapping == 4.0 and gemma3.final_logit_softcapping is None
    # Gemma 3's local and global layers have their own rope (base 10k vs 1M, linear x8).
    layers3 = list(gemma3.model.layers.values())
    assert layers3[0].self_attn.rotary_emb is layers3[1].self_attn.rotary_emb
    assert layers3[0].self_attn.rotary_emb is not layers3[2].self_attn.rotary_emb


def test_fused_checkpoint_tensor_of_the_wrong_size_is_refused(tmp_path_factory) -> None:
    """Phi-3's fused ``qkv_proj``: a tensor whose rows are not q + k + v says what it expected."""
    loaded = load("phi3", tmp_path_factory)
    config = AutoConfig.from_pretrained(loaded.folder)
    model = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    weights = load_file(str(loaded.folder / "model.safetensors"))
    weights["model.layers.0.self_attn.qkv_proj.weight"] = (
        weights["model.layers.0.self_attn.qkv_proj.weight"][:-16])
    with pytest.raises(ValueError, match=r"qkv_proj.weight.*fused checkpoint weight has 112 "
                                         r"rows, expected 128 \(64 \+ 32 \+ 32"):
        model.load_weights(weights.items())
