"""Tiny random EAGLE-1 heads for a tiny Llama target, in the layout the EAGLE authors publish
(see ``octavo.model_executor.models.llama_eagle``): ``config.json`` of a one-layer Llama and one
safetensors file with ``fc.weight`` ``[hidden, 2 * hidden]`` (``fc.bias`` optional),
``layers.0.*`` without ``input_layernorm``, and optionally ``embed_tokens.weight``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def eagle_head_tensors(target_config, seed: int = 0, with_embedding: bool = False,
                       with_fc_bias: bool = False, dtype: torch.dtype = torch.float32,
                       std: float = 0.08) -> dict[str, torch.Tensor]:
    """Random tensors of an EAGLE-1 head for ``target_config`` (a transformers LlamaConfig),
    named as in the published checkpoints."""
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
    head_dim = getattr(target_config, "head_dim", None) or hidden // heads
    inter = target_config.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
        "layers.0.post_attention_layernorm.weight": (1.0 + rand(hidden)).to(dtype),
    }
    if with_fc_bias:
        tensors["fc.bias"] = rand(hidden)
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(target_config.vocab_size, hidden)
    return tensors


def write_eagle_head(folder: Path, target_config, tensors: dict[str, torch.Tensor]) -> Path:
    """Save ``tensors`` and the head's ``config.json`` (the target's config with one layer)
    into ``folder``; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = target_config.to_dict()
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return folder


def make_tiny_eagle_head(folder: Path, target_folder: Path, seed: int = 0,
                         with_embedding: bool = False, with_fc_bias: bool = False,
                         dtype: torch.dtype = torch.float32) -> Path:
    """A random EAGLE-1 head for the tiny Llama target saved in ``target_folder``."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_folder)
    return write_eagle_head(folder, target_config, eagle_head_tensors(
        target_config, seed, with_embedding, with_fc_bias, dtype))


def make_attention_free_target(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny one-layer Llama whose attention output projection is zero: each position's
    logits depend on its own token only (greedy decoding still runs through every engine
    path). ``make_exact_eagle_head`` builds a head that is exactly right for it."""
    from safetensors.torch import load_file

    from octavo.testing.tiny_models import make_tiny_model

    make_tiny_model(folder, "llama", seed=seed, num_hidden_layers=1, **overrides)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.o_proj.weight"].zero_()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(folder)


def make_exact_eagle_head(folder: Path, target_folder: Path) -> Path:
    """An EAGLE-1 head whose proposals equal the greedy tokens of the attention-free target in
    ``target_folder`` (``make_attention_free_target``): ``fc = [I | 0]`` passes the token's
    embedding through, its attention output is zero as the target's, and its MLP and
    post-attention norm are the target's, so its output is the target's last hidden state
    before the final RMSNorm, which scales each row by a positive number and so keeps the
    argmax of the (shared) LM head when the norm's weights are all equal."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_folder)
    target = load_file(str(Path(target_folder) / "model.safetensors"))
    norm = target["model.norm.weight"]
    assert torch.all(norm == norm[0]) and norm[0] > 0, "the target's final norm must be uniform"
    assert not target["model.layers.0.self_attn.o_proj.weight"].any(), (
        "the target must be attention-free (make_attention_free_target)")
    hidden = config.hidden_size
    tensors = {name.removeprefix("model."): tensor for name, tensor in target.items()
               if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)],
                                     dim=1).to(target["model.norm.weight"].dtype)
    return write_eagle_head(folder, config, tensors)
