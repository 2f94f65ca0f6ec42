"""Tiny random EAGLE heads for a tiny Llama target, in the layouts the EAGLE authors publish.

EAGLE-1 (``octavo.model_executor.models.llama_eagle``): ``config.json`` of a one-layer Llama
and one safetensors file with ``fc.weight`` ``[hidden, 2 * hidden]`` (``fc.bias`` optional),
``layers.0.*`` without ``input_layernorm``, and optionally ``embed_tokens.weight``.
EAGLE-3 (``octavo.model_executor.models.llama_eagle3``): ``fc.weight`` ``[hidden, 3 *
hidden]``, ``midlayer.*``, ``norm.weight``, a reduced-vocabulary ``lm_head.weight``, ``d2t``
and ``t2d``. Each kind also has a head built to be exactly right for a special target."""

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


# ---- EAGLE-3 ---------------------------------------------------------------------------------


def default_draft_token_ids(vocab_size: int) -> list[int]:
    """A reduced draft vocabulary for tests: every target id except each fifth from 3 on (so
    ``d2t`` holds offsets 0, 1, 2, ...)."""
    return [t for t in range(vocab_size) if t % 5 != 3]


def eagle3_head_tensors(target_config, seed: int = 0, draft_token_ids: list[int] | None = None,
                        with_embedding: bool = False, dtype: torch.dtype = torch.float32,
                        std: float = 0.08) -> dict[str, torch.Tensor]:
    """Random tensors of an EAGLE-3 head for ``target_config`` (a transformers LlamaConfig),
    named as in the published checkpoints (``octavo.model_executor.models.llama_eagle3``):
    ``fc.weight`` ``[hidden, 3 * hidden]``, ``midlayer.*`` (q/k/v over ``2 * hidden``),
    ``norm.weight``, ``lm_head.weight`` over ``draft_token_ids`` (sorted target ids; default
    ``default_draft_token_ids``), ``d2t`` and ``t2d``."""
    hidden = target_config.hidden_size
    heads = target_config.num_attention_heads
    kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
    head_dim = getattr(target_config, "head_dim", None) or hidden // heads
    inter = target_config.intermediate_size
    vocab = target_config.vocab_size
    ids = sorted(draft_token_ids if draft_token_ids is not None
                 else default_draft_token_ids(vocab))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": (1.0 + rand(hidden)).to(dtype),
        "midlayer.hidden_norm.weight": (1.0 + rand(hidden)).to(dtype),
        "midlayer.post_attention_layernorm.weight": (1.0 + rand(hidden)).to(dtype),
        "norm.weight": (1.0 + rand(hidden)).to(dtype),
        "lm_head.weight": rand(len(ids), hidden) * 4,
        "d2t": torch.tensor(ids, dtype=torch.long) - torch.arange(len(ids)),
        "t2d": t2d,
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    return tensors


def write_eagle3_head(folder: Path, target_config, tensors: dict[str, torch.Tensor],
                      aux_layers: list[int] | None = None, **config_fields) -> Path:
    """Save ``tensors`` and the head's ``config.json`` (the target's config with one layer,
    ``LlamaForCausalLMEagle3``, ``draft_vocab_size`` from ``lm_head.weight``, and
    ``eagle_aux_hidden_state_layer_ids`` when ``aux_layers`` is given; ``config_fields``
    override) into ``folder``; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = target_config.to_dict()
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"])
    if "lm_head.weight" in tensors:
        config["draft_vocab_size"] = tensors["lm_head.weight"].shape[0]
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    config.update(config_fields)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return folder


def make_tiny_eagle3_head(folder: Path, target_folder: Path, seed: int = 0,
                          aux_layers: list[int] | None = None,
                          draft_token_ids: list[int] | None = None,
                          with_embedding: bool = False,
                          dtype: torch.dtype = torch.float32) -> Path:
    """A random EAGLE-3 head for the tiny Llama target saved in ``target_folder``
    (``aux_layers``: the target layers it reads; the tiny targets have too few layers for
    vLLM's default, so it defaults to ``[0, L - 1, L // 2]``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_folder)
    layers = config.num_hidden_layers
    return write_eagle3_head(
        folder, config, eagle3_head_tensors(config, seed, draft_token_ids, with_embedding,
                                            dtype),
        aux_layers if aux_layers is not None else [0, layers - 1, layers // 2])


# Layers of the EAGLE-3 exact-head target, and the aux layers its head reads (the stream
# entering the last layer in the middle slot, so the slot order matters).
EXACT3_LAYERS = 4
EXACT3_AUX_LAYERS = [1, EXACT3_LAYERS - 1, 2]


def make_repeating_target(folder: Path, seed: int = 0, swap_pairs: bool = False,
                          **overrides) -> Path:
    """A tiny ``EXACT3_LAYERS``-layer Llama whose greedy next token is always its current
    token (``swap_pairs``: the other token of its pair ``{2k, 2k + 1}``, so outputs
    alternate): attention-free (every ``o_proj`` zero), its last layer's MLP zero, and its LM
    head row of each token the final-normed stream of the token it follows, so each position's
    logits peak there (the rows all have one norm; distinct rows are not parallel: checked
    here). The earlier layers' MLPs are random, so the stream entering each layer differs
    (``make_exact_eagle3_head`` must read the right one)."""
    from safetensors.torch import load_file

    from octavo.testing.tiny_models import make_tiny_model

    make_tiny_model(folder, "llama", seed=seed, num_hidden_layers=EXACT3_LAYERS, **overrides)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    for i in range(EXACT3_LAYERS):
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
    tensors[f"model.layers.{EXACT3_LAYERS - 1}.mlp.down_proj.weight"].zero_()
    final = _final_streams(tensors)  # [vocab, hidden]
    successor = torch.arange(final.shape[0])
    if swap_pairs:
        successor = successor ^ 1
    lm_head = final[successor]  # row b: the stream of the token b follows (an involution)
    assert torch.equal((final @ lm_head.T).argmax(dim=-1), successor), (
        "two tokens give parallel streams; pick another seed")
    tensors["lm_head.weight"] = lm_head.to(tensors["lm_head.weight"].dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(folder)


def make_exact_eagle3_head(folder: Path, target_folder: Path,
                           draft_token_ids: list[int] | None = None) -> Path:
    """An EAGLE-3 head for the target in ``target_folder`` (``make_repeating_target``) that
    proposes, at every step, the token of the aux state it read (the token before the newest):
    ``fc`` picks the middle aux state (the stream entering the target's last layer, which
    adds nothing), its attention output and MLP are zero, so ``p = g`` at every step, its
    final norm is the target's and its LM head row of each draft token that token's final
    stream, so its argmax maps back through ``d2t`` to that token. For a repeating target
    every proposal of a draftable token is right; with ``swap_pairs`` the first of each
    step is (the token after next of an alternating pair is the token itself) and the
    others are not."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_folder)
    target = load_file(str(Path(target_folder) / "model.safetensors"))
    assert not target[f"model.layers.{EXACT3_LAYERS - 1}.mlp.down_proj.weight"].any(), (
        "the target must be make_repeating_target's")
    hidden = config.hidden_size
    tensors = eagle3_head_tensors(config, seed=1, draft_token_ids=draft_token_ids)
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)
    tensors["fc.weight"] = torch.cat([zero, eye, zero], dim=1)
    tensors["midlayer.self_attn.o_proj.weight"].zero_()
    tensors["midlayer.mlp.down_proj.weight"].zero_()
    tensors["norm.weight"] = target["model.norm.weight"].clone()
    ids = torch.tensor(sorted(draft_token_ids if draft_token_ids is not None
                              else default_draft_token_ids(config.vocab_size)))
    tensors["lm_head.weight"] = _final_streams(target)[ids].to(target["lm_head.weight"].dtype)
    return write_eagle3_head(folder, config, tensors, EXACT3_AUX_LAYERS)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _final_streams(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each token's final-normed stream through the attention-free target, ``[vocab,
    hidden]`` float32."""
    return _rms_norm(_attention_free_streams(tensors, EXACT3_LAYERS)[-1],
                     tensors["model.norm.weight"].float())


def _attention_free_streams(tensors: dict[str, torch.Tensor], num_layers: int
                            ) -> list[torch.Tensor]:
    """The residual stream of every token entering each layer and after the last (a list of
    ``num_layers + 1`` ``[vocab, hidden]``), for a Llama whose attention adds nothing."""
    stream = tensors["model.embed_tokens.weight"].float()
    streams = [stream]
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        x = _rms_norm(stream, tensors[prefix + "post_attention_layernorm.weight"].float())
        gate = x @ tensors[prefix + "mlp.gate_proj.weight"].float().T
        up = x @ tensors[prefix + "mlp.up_proj.weight"].float().T
        stream = stream + (torch.nn.functional.silu(gate) * up) @ tensors[
            prefix + "mlp.down_proj.weight"].float().T
        streams.append(stream)
    return streams
