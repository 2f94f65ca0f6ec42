"""Llama-style decoder, the one model body behind Llama, Mistral, Qwen2 and Qwen3.

Pre-norm decoder layers (RMSNorm -> attention -> RMSNorm -> SiLU-gated MLP) with rotary
positions. Q/K/V are one merged projection and gate/up another (one matmul each); the separate
Hugging Face tensors are copied into row slices of them by ``load_weights``. The variants differ
only through :class:`DecoderOptions` and ``sliding_window``, chosen by small subclasses.

Parameters are allocated uninitialised on the current default device and dtype (the runner
sets both around construction); ``load_weights`` must fill every one of them before use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.model_executor.layers import Attention, RMSNorm, RotaryEmbedding, SiluAndMul, get_rope


@dataclass(slots=True, frozen=True)
class DecoderOptions:
    """Architecture switches of the shared decoder body."""

    # Biases on the q/k/v projections (Qwen2: always; Llama/Qwen3: config.attention_bias).
    qkv_bias: bool = False
    # Bias on the attention output projection.
    o_bias: bool = False
    # Biases on gate/up/down projections (Llama: config.mlp_bias).
    mlp_bias: bool = False
    # Per-head RMSNorm of queries and keys before rope (Qwen3).
    qk_norm: bool = False


def uninitialized(module_cls: type[nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Build ``module_cls`` with allocated but uninitialised parameters on the default device.

    Skips the random init (minutes for a large model on CPU); ``load_weights`` overwrites it.
    """
    return nn.utils.skip_init(module_cls, *args, device=torch.get_default_device(), **kwargs)


class MergedLinear(nn.Linear):
    """Several projections of the same input stacked along the output dimension.

    ``shard_names[i]`` (the checkpoint's name for projection ``i``, e.g. ``"k_proj"``) owns
    ``output_sizes[i]`` consecutive output rows of ``weight`` and ``bias``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        shard_names: Sequence[str],
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        assert len(output_sizes) == len(shard_names), "one output size per shard name"
        super().__init__(in_features, sum(output_sizes), bias=bias, device=device, dtype=dtype)
        self.output_sizes = tuple(output_sizes)
        self.shard_names = tuple(shard_names)

    def shard(self, param: torch.Tensor, shard_name: str) -> torch.Tensor:
        """The rows of ``param`` (this layer's weight or bias) that ``shard_name`` owns."""
        index = self.shard_names.index(shard_name)
        start = sum(self.output_sizes[:index])
        return param.narrow(0, start, self.output_sizes[index])


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up merged into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = uninitialized(
            MergedLinear, hidden_size, [intermediate_size] * 2, ["gate_proj", "up_proj"], bias
        )
        self.down_proj = uninitialized(nn.Linear, intermediate_size, hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        return self.down_proj(self.act(gate_up))  # [num_tokens, hidden_size]


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = uninitialized(
            MergedLinear,
            hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            ["q_proj", "k_proj", "v_proj"],
            options.qkv_bias,
        )
        self.o_proj = uninitialized(nn.Linear, self.q_size, hidden_size, bias=options.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if options.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if options.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, attn_backend
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, q_size]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block; carries the residual stream separately so norms can fuse the add."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, options, rotary_emb, attn_backend)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, options.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for the first layer
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(block output, residual)``; their sum is the stream after this layer."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of HF weight names)."""

    def __init__(self, config: Any, options: DecoderOptions, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = uninitialized(nn.Embedding, config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config, head_dim_of(config))  # shared by every layer
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, rotary_emb, attn_backend)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; the interface the model runner calls.

    ``sliding_window`` is the config's window (``None``: full attention). Octavo's attention
    does not implement sliding windows, so the engine must cap ``max_model_len`` to it.
    """

    def __init__(self, config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.options = self.decoder_options(config)
        self.sliding_window: int | None = self.sliding_window_of(config)
        self.model = LlamaModel(config, self.options, attn_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: nn.Linear | None = None
        if not self.tie_word_embeddings:
            self.lm_head = uninitialized(nn.Linear, config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        """The architecture switches for ``config``; subclasses override."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    @classmethod
    def sliding_window_of(cls, config: Any) -> int | None:
        """The attention window the checkpoint was trained with (``None``: none)."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # one per layer, the backend's layout
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 ``[n, vocab_size]`` (matmul in the model dtype)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_states, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (see :func:`load_hf_weights`)."""
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_hf_weights(self, weights, skip_names=skip)


# Checkpoint buffers that hold no learned weight (rope tables some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# How many names an error message lists before summarising.
_MAX_LISTED = 20


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip_names: Iterable[str] = (),
) -> None:
    """Copy ``(name, tensor)`` pairs named as in the HF checkpoint into ``model``'s parameters.

    A name is either a parameter's own name, or ``<parent>.<shard>.<weight|bias>`` where
    ``<parent>`` holds a :class:`MergedLinear` with that shard name (``...self_attn.k_proj.weight``
    fills the ``k_proj`` rows of ``...self_attn.qkv_proj.weight``). Tensors are cast to the
    parameter's dtype and device. Names in ``skip_names`` and rope buffers are ignored.

    Raises ``ValueError`` on a shape mismatch, and after the last tensor when any parameter
    (or merged shard) received no weight or any name matched nothing; the message lists them.
    """
    params = dict(model.named_parameters())
    shard_owner: dict[str, tuple[str, MergedLinear, str]] = {}
    expected: set[tuple[str, str | None]] = set()
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shard_names:
                shard_owner[f"{parent}.{shard}" if parent else shard] = (path, module, shard)
                expected.update((f"{path}.{attr}", shard) for attr, _ in module.named_parameters())
    merged_params = {name for name, _ in expected}
    expected.update((name, None) for name in params if name not in merged_params)

    skip = set(skip_names)
    loaded: set[tuple[str, str | None]] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            if name in skip or name.endswith(_IGNORED_SUFFIXES):
                continue
            prefix, _, attr = name.rpartition(".")
            if prefix in shard_owner:
                path, module, shard = shard_owner[prefix]
                target = f"{path}.{attr}"
                if target not in params:
                    unknown.append(name)
                    continue
                dest, key = module.shard(params[target].data, shard), (target, shard)
            elif name in params:
                dest, key = params[name].data, (name, None)
            else:
                unknown.append(name)
                continue
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, but "
                    f"{key[0]}{f'[{key[1]}]' if key[1] else ''} expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(key)

    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    problems = []
    if missing:
        problems.append(f"no weight for {len(missing)} parameter(s): {_listing(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} unknown weight name(s): {_listing(unknown)}")
    if problems:
        raise ValueError(
            f"cannot load checkpoint into {type(model).__name__}: " + "; ".join(problems)
        )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


def head_dim_of(config: Any) -> int:
    """``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
