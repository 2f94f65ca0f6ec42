"""The EAGLE-3 draft head of a Llama-architecture target (``"method": "eagle3"`` speculation).

Where an EAGLE-1 head (``llama_eagle``) reads the target's last hidden state, an EAGLE-3 head
reads three of the target's intermediate ones (the residual stream entering three decoder
layers, "auxiliary hidden states": by default layers ``(2, L // 2, L - 3)`` of an L-layer
target, or the head config's ``eagle_aux_hidden_state_layer_ids``), fused by one projection.
For the row of position t (token ``t + 1``, rope position and KV slot t, as EAGLE-1)::

    g_t = fc(concat(aux_1_t, aux_2_t, aux_3_t))        # first draft step: the target's
    g_t = p_{t-1 step}                                  # later draft steps: its own p (no fc)
    a_t = attn(concat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t)))  # 2 * hidden in
    r_t = g_t + a_t                   # (norm_before_residual: hidden_norm(g_t) + a_t)
    p_t = r_t + mlp(post_attention_layernorm(r_t))      # "pre-norm" output, fed back
    logits_t = lm_head(norm(p_t))     # over the head's own reduced vocabulary

The head's ``lm_head`` covers ``draft_vocab_size`` tokens; draft id d is target id
``d + d2t[d]``. ``compute_logits`` returns logits over the *target's* vocabulary (``-inf``
outside the draft's tokens), so a softmax of them is the draft's distribution scattered into
the target vocabulary, zero elsewhere, and the proposer and rejection sampler work in target
ids throughout.

Checkpoint layout (as the EAGLE authors publish it, e.g. ``EAGLE3-LLaMA3.1-Instruct-8B``, as
safetensors): ``config.json`` (``LlamaForCausalLMEagle3``-style: ``hidden_size``,
``draft_vocab_size``, optionally ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``,
``norm_before_residual``); ``fc.weight`` ``[hidden, 3 * target_hidden]``;
``midlayer.self_attn.{q,k,v}_proj.weight`` of input ``2 * hidden``, ``o_proj``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``; ``norm.weight``; ``lm_head.weight`` ``[draft_vocab,
hidden]``; ``d2t`` (int64 ``[draft_vocab]``) and ``t2d`` (bool ``[vocab]``, not needed: it
is d2t's inverse); ``embed_tokens.weight`` optional (without it the target's embedding is
shared). The head runs whole on every tensor-parallel rank (replicated).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers import RMSNorm, get_rope
from octavo.model_executor.layers.linear import qkv_parallel
from octavo.model_executor.layers.vocab import (
    ParallelLMHead,
    VocabParallelEmbedding,
    compute_logits,
)
from octavo.model_executor.layers.weights import Loaded, materialize
from octavo.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    effective_sliding_windows,
    head_dim_of,
    load_hf_weights,
)

# Checkpoint names.
FC_WEIGHT = "fc.weight"
LM_HEAD_WEIGHT = "lm_head.weight"
EMBED_WEIGHT = "embed_tokens.weight"
D2T = "d2t"
T2D = "t2d"
# How many target layers feed the head.
NUM_AUX_LAYERS = 3


def draft_vocab_size(config: Any) -> int:
    """The head's own vocabulary (``draft_vocab_size``; the target's when absent)."""
    return int(getattr(config, "draft_vocab_size", None) or config.vocab_size)


def target_hidden_size(config: Any) -> int:
    """The width of each auxiliary hidden state (``target_hidden_size``, else the head's)."""
    return int(getattr(config, "target_hidden_size", None) or config.hidden_size)


def aux_hidden_state_layers(head_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input stream the head reads: the head config's
    ``eagle_aux_hidden_state_layer_ids`` when set, else vLLM's default ``(2, L // 2, L - 3)``
    (layer 0's input is the embedding). ``ValueError`` (one line) when they are not three
    layers of the target."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    layers = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != NUM_AUX_LAYERS or not all(
            isinstance(i, int) and 0 <= i < num_target_layers for i in layers):
        raise ValueError(f"speculative_config: the EAGLE-3 head reads target layers "
                         f"{list(layers)}, but the target has {num_target_layers} layers; "
                         "set eagle_aux_hidden_state_layer_ids in the head's config.json to "
                         f"three layer numbers below {num_target_layers}")
    return layers


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's one decoder layer (``midlayer.*``): attention over the concatenation of the
    normed token embedding and the normed hidden input (q/k/v take ``2 * hidden``), then the
    post-attention norm and MLP; returns the pre-norm output ``p`` (see the module doc)."""

    def __init__(self, config: Any, options: DecoderOptions, attn_backend: AttentionBackend,
                 max_model_len: int | None) -> None:
        super().__init__()
        parallel = ParallelState.single()
        hidden = config.hidden_size
        window = effective_sliding_windows(config, max_model_len)[0]
        rope = get_rope(config, head_dim_of(config), None, max_model_len=max_model_len)
        self.self_attn = LlamaAttention(config, options, rope, attn_backend, parallel,
                                        prefix="midlayer.self_attn", sliding_window=window)
        # The projection LlamaAttention built takes `hidden` inputs; EAGLE-3's takes two.
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.self_attn.qkv_proj = qkv_parallel(
            2 * hidden, head_dim_of(config), total_heads, total_kv_heads, options.qkv_bias,
            parallel, None, "midlayer.self_attn.qkv_proj")
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, options.mlp_bias, parallel,
                            prefix="midlayer.mlp")
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
                ) -> torch.Tensor:  # [num_tokens, hidden]
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [n, 2 * hidden]
        attn = self.self_attn(positions, x, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(attn, residual)  # residual += attn
        return self.mlp(normed) + residual


class Eagle3LlamaForCausalLM(nn.Module):
    """The EAGLE-3 head (see the module doc). Built with uninitialised parameters like every
    model (``load_weights`` fills them); ``share_target`` must be called before ``forward``
    when the checkpoint has no embedding (``has_embedding``)."""

    def __init__(self, config: Any, attn_backend: AttentionBackend, has_embedding: bool,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = draft_vocab_size(config)
        # Width of the target hidden rows the first draft step takes (the three aux states).
        self.input_hidden_size = NUM_AUX_LAYERS * target_hidden_size(config)
        options = LlamaForCausalLM.decoder_options(config)
        self.fc = nn.Linear(self.input_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, options, attn_backend, max_model_len)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        single = ParallelState.single()
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, single)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if has_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, single)
        # Draft id -> target id (d + d2t[d], precomputed; filled by load_weights).
        self.register_buffer("draft_to_target",
                             torch.arange(self.draft_vocab_size, dtype=torch.long),
                             persistent=False)
        # Draft ids are target ids (same vocabulary, identity map): logits need no scatter.
        self._is_identity = self.draft_vocab_size == self.vocab_size
        # The target's embedding when the head has none (kept out of this module's
        # parameters so loading and counting see only the head's).
        self._shared: dict[str, VocabParallelEmbedding] = {}

    def share_target(self, target: nn.Module) -> None:
        """Take the target's token embedding when this head has none."""
        if self.embed_tokens is not None:
            return
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        if embed is None:
            raise ValueError(f"speculative_config: an EAGLE-3 head without embed_tokens "
                             f"needs the target's embedding, which {type(target).__name__} "
                             "does not expose")
        self._shared["embed_tokens"] = embed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        embed = self.embed_tokens or self._shared.get("embed_tokens")
        assert embed is not None, "share_target() must run before the head's forward"
        return embed(input_ids)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """``[n, 3 * target_hidden]`` (the target's aux states) -> ``[n, hidden]``: the
        hidden input of the first draft step."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: token t + 1 at the row of position t
        positions: torch.Tensor,  # [num_tokens]: t (rope and the KV slot written)
        kv_caches: list[torch.Tensor],  # one layer
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor,  # [num_tokens, hidden]: combine_hidden_states(aux), or p
    ) -> torch.Tensor:  # [num_tokens, hidden]: p, for compute_logits and the next step
        if len(kv_caches) != 1:
            raise ValueError(f"got {len(kv_caches)} KV caches for the EAGLE-3 head's 1 layer")
        embeds = self.embed(input_ids)
        return self.midlayer(positions, embeds, hidden.to(embeds.dtype), kv_caches[0],
                             attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (p) -> float32 ``[n, target vocab]``: the head's logits at the
        target ids of its tokens, ``-inf`` at every other target id."""
        draft = compute_logits(self.norm(hidden_states), self.lm_head)  # [n, draft vocab]
        if self._is_identity:
            return draft
        logits = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        return logits.index_copy_(1, self.draft_to_target, draft)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Copy the checkpoint's tensors in (names as in the module doc; a leading ``model.``
        is accepted too) and check ``d2t``. ``ValueError`` lists missing and unknown names,
        or says what is wrong with ``d2t``."""
        mapping: list[torch.Tensor] = []  # d2t, when the checkpoint has it

        def layer_weights() -> Iterable[tuple[str, Loaded]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name == D2T:
                    mapping.append(materialize(tensor))
                elif name != T2D:
                    yield name, tensor

        load_hf_weights(self, layer_weights())
        if not mapping:
            if self.draft_vocab_size != self.vocab_size:
                raise ValueError(
                    f"speculative_config: the EAGLE-3 head has a {self.draft_vocab_size}-token "
                    f"vocabulary but no {D2T!r} tensor mapping it to the target's "
                    f"{self.vocab_size} tokens; use the complete checkpoint")
            return
        self.draft_to_target.copy_(draft_to_target_ids(
            mapping[0], self.draft_vocab_size, self.vocab_size))
        self._is_identity = bool(torch.equal(
            self.draft_to_target.cpu(), torch.arange(self.draft_vocab_size)))


def draft_to_target_ids(d2t: torch.Tensor, num_draft: int, num_target: int) -> torch.Tensor:
    """Target ids ``d + d2t[d]`` of the ``num_draft`` draft tokens; ``ValueError`` (one line)
    unless ``d2t`` is an integer ``[num_draft]`` tensor mapping to distinct target ids."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (
            num_draft,):
        raise ValueError(f"speculative_config: the EAGLE-3 head's {D2T!r} has shape "
                         f"{list(d2t.shape)} and dtype {d2t.dtype}, expected integers of "
                         f"[{num_draft}] (draft_vocab_size); use the checkpoint's own d2t")
    ids = torch.arange(num_draft) + d2t.to(torch.long).cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_target
                        or ids.unique().numel() != num_draft):
        raise ValueError(f"speculative_config: the EAGLE-3 head's {D2T!r} maps draft tokens "
                         f"outside the target's {num_target}-token vocabulary or two to one "
                         "id; use the head trained for this target")
    return ids
