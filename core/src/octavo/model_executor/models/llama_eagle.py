"""The EAGLE-1 draft head of a Llama-architecture target (``"method": "eagle"`` speculation).

The head is one Llama decoder layer fed by a projection of two things per position t: the
embedding of token ``t + 1`` and the target's hidden state at t (what the target's decoder
returns, the input of its LM head, so after its final norm: what vLLM hands EAGLE-1 heads and
what the EAGLE authors trained them on)::

    x_t = fc(concat(embed(token_{t+1}), target_hidden_t))      # [hidden]
    h_t = layer(x_t)   # attention over the head's own KV cache, then the MLP; residuals kept
    logits_t = lm_head(h_t)                                     # the target's LM head

The row of position t (its rope position and the KV slot it writes) is t, as in vLLM: the
head's KV lies in the same slots as the target's KV of the same positions. EAGLE-1's layer has
no ``input_layernorm`` (the projection's output goes straight into attention; the
post-attention norm is there), there is no final norm, and the head's next draft steps feed
``h_t`` back as the "target hidden" of the following position.

Checkpoint layout (as the EAGLE authors publish it, e.g. ``EAGLE-LLaMA3-Instruct-8B``, as
safetensors): ``config.json`` of a one-layer Llama; ``fc.weight`` ``[hidden, 2 * hidden]``
(``fc.bias`` optional); ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``;
``embed_tokens.weight`` optional (without it the target's embedding is shared). The LM head is
always the target's.

The head runs whole on every tensor-parallel rank (replicated, as a draft model is); only the
shared embedding and LM head may be the target's vocabulary-parallel ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers import RMSNorm, get_rope
from octavo.model_executor.layers.vocab import (
    VocabParallelEmbedding,
    compute_logits,
)
from octavo.model_executor.layers.weights import Loaded
from octavo.model_executor.models.llama import (
    DecoderOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    effective_sliding_windows,
    head_dim_of,
    load_hf_weights,
)

# Checkpoint names of the projection (the one tensor every EAGLE head has).
FC_WEIGHT = "fc.weight"
FC_BIAS = "fc.bias"
EMBED_WEIGHT = "embed_tokens.weight"


class EagleDecoderLayer(nn.Module):
    """EAGLE-1's decoder layer: attention on the projected input as is (no input norm), then
    the post-attention norm and the MLP, both residuals kept."""

    def __init__(self, config: Any, options: DecoderOptions, attn_backend: AttentionBackend,
                 max_model_len: int | None) -> None:
        super().__init__()
        parallel = ParallelState.single()
        window = effective_sliding_windows(config, max_model_len)[0]
        rope = get_rope(config, head_dim_of(config), None, max_model_len=max_model_len)
        self.self_attn = LlamaAttention(config, options, rope, attn_backend, parallel,
                                        prefix="layers.0.self_attn", sliding_window=window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, options.mlp_bias,
                            parallel, prefix="layers.0.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden]
        attn = self.self_attn(positions, x, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm(attn, x)  # residual = x + attn
        return self.mlp(normed) + residual


class EagleLlamaForCausalLM(nn.Module):
    """The EAGLE-1 head (see the module doc). Built with uninitialised parameters like every
    model (``load_weights`` fills them); ``share_target`` must be called before ``forward``:
    it gives the head the target's LM head, and its embedding when the checkpoint has none.

    ``has_embedding``: the checkpoint carries ``embed_tokens.weight`` (the head then owns an
    embedding of the target's vocabulary size)."""

    def __init__(self, config: Any, attn_backend: AttentionBackend, has_embedding: bool,
                 has_fc_bias: bool, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        options = LlamaForCausalLM.decoder_options(config)
        self.fc = nn.Linear(2 * hidden, hidden, bias=has_fc_bias)
        self.layers = nn.ModuleDict({"0": EagleDecoderLayer(config, options, attn_backend,
                                                            max_model_len)})
        self.embed_tokens: VocabParallelEmbedding | None = None
        if has_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden,
                                                       ParallelState.single())
        # The target's LM head (and embedding when the head has none), set by share_target;
        # kept out of this module's parameters so loading and counting see only the head's.
        self._shared: dict[str, VocabParallelEmbedding] = {}

    def share_target(self, target: nn.Module) -> None:
        """Take the target's LM head (always) and its token embedding (when this head has
        none). ``target``: a Llama-style ``*ForCausalLM`` on the last (only) pipeline stage."""
        lm_head = getattr(target, "lm_head", None)
        embed = getattr(getattr(target, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None:
            raise ValueError(f"speculative_config: an EAGLE head needs the target's embedding "
                             f"and LM head, which {type(target).__name__} does not expose")
        self._shared["lm_head"] = lm_head
        if self.embed_tokens is None:
            self._shared["embed_tokens"] = embed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        embed = self.embed_tokens or self._shared.get("embed_tokens")
        assert embed is not None, "share_target() must run before the head's forward"
        return embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: token t + 1 at the row of position t
        positions: torch.Tensor,  # [num_tokens]: t (rope and the KV slot written, as vLLM)
        kv_caches: list[torch.Tensor],  # one layer
        attn_metadata: AttentionMetadata,
        target_hidden: torch.Tensor,  # [num_tokens, hidden]: the target's (or head's) at t
    ) -> torch.Tensor:  # [num_tokens, hidden]: h, for the LM head and the next draft step
        if len(kv_caches) != 1:
            raise ValueError(f"got {len(kv_caches)} KV caches for the EAGLE head's 1 layer")
        embeds = self.embed(input_ids)
        x = self.fc(torch.cat([embeds, target_hidden.to(embeds.dtype)], dim=-1))
        return self.layers["0"](positions, x, kv_caches[0], attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 ``[n, vocab]`` through the target's LM head."""
        lm_head = self._shared.get("lm_head")
        assert lm_head is not None, "share_target() must run before compute_logits"
        return compute_logits(hidden_states, lm_head)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Copy the EAGLE checkpoint's tensors in (names as in the module doc; a leading
        ``model.`` is accepted too). ``ValueError`` lists missing and unknown names."""
        renamed = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        load_hf_weights(self, renamed, skip_names=("lm_head.weight",))
