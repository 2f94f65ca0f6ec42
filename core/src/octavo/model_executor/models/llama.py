"""Llama-style decoder, the one model body behind Llama, Mistral, Qwen2, Qwen3 and Phi-3 (and,
with its own layers, Gemma 2/3: ``octavo.model_executor.models.gemma``).

Pre-norm decoder layers (RMSNorm -> attention -> RMSNorm -> SiLU-gated MLP) with rotary
positions. Q/K/V are one merged projection and gate/up another (one matmul each); the separate
Hugging Face tensors (or one fused tensor, Phi-3) are copied into their shards by each
parameter's ``weight_loader``. The variants differ only through :class:`DecoderOptions`, chosen
by small subclasses, and the config: each layer's sliding window comes from it
(``octavo.config.layer_sliding_windows``: Mistral, Qwen with ``use_sliding_window``, Phi-3),
dropped where the engine's ``max_model_len`` fits in it.

Split over devices (``octavo.distributed``): the projections are column-/row-parallel
(``octavo.model_executor.layers.linear``), the embedding and LM head vocabulary-parallel, KV
heads partitioned (or replicated when fewer than the ranks); with pipeline parallelism each
stage builds only its own layers (the first the embedding, the last the norm and LM head) and
hands hidden states on as ``IntermediateTensors``.

Parameters are allocated uninitialised on the current default device and dtype (the runner
sets both around construction); ``load_weights`` must fill every one of them before use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.config import layer_sliding_windows
from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers import Attention, RMSNorm, RotaryEmbedding, SiluAndMul, get_rope
from octavo.model_executor.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    local_kv_heads,
    merged_column_parallel,
    qkv_parallel,
)
from octavo.model_executor.layers.quantization.base import QuantizationConfig
from octavo.model_executor.layers.rotary import rope_layer_type
from octavo.model_executor.layers.vocab import (
    ParallelLMHead,
    VocabParallelEmbedding,
    compute_logits,
)
from octavo.model_executor.layers.weights import Loaded, layout_of, weight_loader_of
from octavo.model_executor.models.interfaces import IntermediateTensors


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


def stage_layers(num_layers: int, parallel: ParallelState) -> range:
    """The decoder layers of this rank's pipeline stage: an even split, the first stages taking
    one more when it does not divide."""
    pp, stage = parallel.ranks.pp_size, parallel.ranks.pp_rank
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot be split into {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def effective_sliding_windows(config: Any, max_model_len: int | None) -> tuple[int | None, ...]:
    """Each layer's attention window, ``None`` where there is none or where ``max_model_len``
    fits in it (full attention is then the same and needs no window support)."""
    return tuple(w if w is not None and (max_model_len is None or w < max_model_len) else None
                 for w in layer_sliding_windows(config))


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up merged into one matmul (SiLU unless
    ``act`` says otherwise)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 parallel: ParallelState, reduce_results: bool = True,
                 act: nn.Module | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = merged_column_parallel(
            hidden_size, [intermediate_size] * 2, ["gate_proj", "up_proj"], bias, parallel,
            quant_config, f"{prefix}.gate_up_proj")
        # reduce_results=False: a split MLP returns this rank's partial sum (MoE shared experts).
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, parallel,
                                           reduce_results, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act = act if act is not None else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / tp]
        return self.down_proj(self.act(gate_up))  # [num_tokens, hidden_size]

    def forward_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(forward(h), s)`` for ``h, s = norm(x, residual)``, the norm inside gate_up's
        kernel (``ColumnParallelLinear.forward_add_rms_norm``), or ``None``: the caller runs
        the norm and ``forward``."""
        fused = self.gate_up_proj.forward_add_rms_norm(x, residual, norm)
        if fused is None:
            return None
        gate_up, residual = fused
        return self.down_proj(self.act(gate_up)), residual


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache (this rank's heads).

    ``sliding_window``: this layer's window (``None``: full attention); ``scale``: the softmax
    scale (default ``head_dim ** -0.5``); ``logits_soft_cap``: Gemma 2's cap; ``norm_cls``: the
    class of the q/k norms when ``options.qk_norm``.
    """

    def __init__(self, config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, parallel: ParallelState,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 sliding_window: int | None = None, scale: float | None = None,
                 logits_soft_cap: float | None = None,
                 norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        self.num_heads = total_heads // parallel.tp_size
        self.num_kv_heads = local_kv_heads(total_kv_heads, parallel.tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj: ColumnParallelLinear = qkv_parallel(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, options.qkv_bias,
            parallel, quant_config, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        options.o_bias, parallel, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps) if options.qk_norm else None
        self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps) if options.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim,
            self.head_dim**-0.5 if scale is None else scale, attn_backend,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.attend(positions, self.qkv_proj(hidden_states), kv_cache, attn_metadata)

    def attend(
        self,
        positions: torch.Tensor,  # [num_tokens]
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: qkv_proj's output
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """``forward`` after the qkv projection (a decoder layer that put its norm inside
        that projection's kernel calls this)."""
        num_tokens = qkv.shape[0]
        # One view of the heads, split along them: the same strided views as splitting the
        # features and viewing each part, for two fewer view ops (~1.5 µs of host per layer).
        heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotated and attended; the backend may rotate the keys into the cache in one kernel.
        out = self.attn.forward_rotary(positions, self.rotary_emb, q, k, v, kv_cache,
                                       attn_metadata)  # [num_tokens, q_size]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block; carries the residual stream separately so norms can fuse the add.

    ``mlp`` is the feed-forward block (``[num_tokens, hidden_size]`` in and out): a
    ``LlamaMLP``, or a mixture of experts. ``sliding_window``: the layer's attention window.
    """

    def __init__(self, config: Any, options: DecoderOptions, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, parallel: ParallelState,
                 mlp: nn.Module, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, options, rotary_emb, attn_backend, parallel,
                                        quant_config, f"{prefix}.self_attn",
                                        sliding_window=sliding_window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A backend's whole-layer kernel, installed after loading (the CPU backend's
        # octavo_cpu.fused_layer): same arguments and results as forward, or None for a step
        # it does not take. None here: forward's own body runs.
        self.fused_forward: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for the first layer
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(block output, residual)``; their sum is the stream after this layer."""
        if self.fused_forward is not None:
            fused = self.fused_forward(positions, hidden_states, residual, kv_cache,
                                       attn_metadata)
            if fused is not None:
                return fused
        # A linear method may take each norm into the kernel of the projection after it
        # (forward_add_rms_norm: int4 at one row on the CUDA backend); else the norm runs.
        qkv_and_residual = None
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            qkv_and_residual = self.self_attn.qkv_proj.forward_add_rms_norm(
                hidden_states, residual, self.input_layernorm)
            if qkv_and_residual is None:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if qkv_and_residual is None:
            hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        else:
            qkv, residual = qkv_and_residual
            hidden_states = self.self_attn.attend(positions, qkv, kv_cache, attn_metadata)
        if isinstance(self.mlp, LlamaMLP):
            mlp_and_residual = self.mlp.forward_add_rms_norm(hidden_states, residual,
                                                             self.post_attention_layernorm)
            if mlp_and_residual is not None:
                return mlp_and_residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


# (config, global layer index, parallel state) -> the layer's feed-forward block.
MakeMLP = Callable[[Any, int, ParallelState], nn.Module]


def make_llama_mlp(config: Any, options: DecoderOptions, parallel: ParallelState,
                   quant_config: QuantizationConfig | None = None, prefix: str = "") -> LlamaMLP:
    """The dense SiLU-gated MLP of ``config.intermediate_size`` (``prefix``: its HF name, for
    the quantization method)."""
    return LlamaMLP(config.hidden_size, config.intermediate_size, options.mlp_bias, parallel,
                    quant_config=quant_config, prefix=prefix)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of HF weight names);
    under pipeline parallelism only this stage's part of them.

    ``make_mlp`` builds each layer's feed-forward block (default: ``LlamaMLP``). Subclasses
    change the layers through ``make_layer``, the final norm through ``norm_cls`` and the
    embedding through ``embed``. ``max_model_len`` (the engine's context length, or ``None``)
    drops windows that do not bind and fixes length-dependent rope scaling. ``quant_config``
    gives every linear layer its quantization method (named by its HF path, ``prefix``).
    """

    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, config: Any, options: DecoderOptions, attn_backend: AttentionBackend,
                 parallel: ParallelState, make_mlp: MakeMLP | None = None,
                 quant_config: QuantizationConfig | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.parallel = parallel
        self.max_model_len = max_model_len
        self.hidden_size = config.hidden_size
        # Given to every linear layer this body builds (None: dense weights).
        self.quant_config = quant_config
        if make_mlp is None:
            def make_mlp(config: Any, index: int, parallel: ParallelState) -> nn.Module:
                return make_llama_mlp(config, options, parallel, quant_config,
                                      f"model.layers.{index}.mlp")
        self.make_mlp: MakeMLP = make_mlp
        self.embed_tokens: VocabParallelEmbedding | None = None
        if parallel.ranks.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                       parallel)
        # Per layer (all of them, indexed by the global layer number).
        self.sliding_windows = effective_sliding_windows(config, max_model_len)
        # One rotary embedding per rope parameter set (per layer type for Gemma 3), shared by
        # the layers that use it; filled by rope_for.
        self.rotary_embs = nn.ModuleDict()
        self.layer_range = stage_layers(config.num_hidden_layers, parallel)
        # Indexed by the global layer number (HF names); layers of other stages are absent.
        self.layers = nn.ModuleDict({
            str(i): self.make_layer(config, i, options, attn_backend, parallel)
            for i in self.layer_range
        })
        self.norm: nn.Module | None = None
        if parallel.ranks.is_last_stage:
            self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3 (set_aux_hidden_state_layers): the layers whose input stream each forward
        # copies into aux_hidden_states; () and None: off, nothing is copied.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...], max_tokens: int,
                                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """From now on every forward writes, for each token, the residual stream entering
        each of ``layers`` (global layer numbers; 0 is the embedding; the output of layer
        ``i - 1`` with its residual added, as vLLM gives EAGLE-3 heads) side by side into
        rows ``[:num_tokens]`` of the returned persistent buffer ``[max_tokens, len(layers)
        * hidden]`` (``aux_hidden_states``; persistent so captured graphs write it where it
        is). Read it after a forward and before the next. These states are whole on every
        tensor-parallel rank (after the row-parallel reduce)."""
        bad = [i for i in layers if i not in self.layer_range]
        if bad or not layers:
            raise ValueError(f"auxiliary hidden-state layers {list(layers)}: each must be a "
                             f"layer of this model (0 .. {self.layer_range.stop - 1})")
        self.aux_hidden_state_layers = tuple(layers)
        self.aux_hidden_states = torch.zeros(max_tokens, len(layers) * self.hidden_size,
                                             dtype=dtype, device=device)
        return self.aux_hidden_states

    def make_layer(self, config: Any, index: int, options: DecoderOptions,
                   attn_backend: AttentionBackend, parallel: ParallelState) -> nn.Module:
        """Decoder layer ``index`` (its forward as ``LlamaDecoderLayer.forward``)."""
        return LlamaDecoderLayer(config, options, self.rope_for(config, index), attn_backend,
                                 parallel, self.make_mlp(config, index, parallel),
                                 self.quant_config, f"model.layers.{index}",
                                 sliding_window=self.sliding_windows[index])

    def rope_for(self, config: Any, index: int) -> RotaryEmbedding:
        """The rotary embedding of layer ``index``: the model's one, or its layer type's when
        the config has rope parameters per layer type."""
        layer_type = rope_layer_type(config, index)
        key = layer_type or "all"
        if key not in self.rotary_embs:
            self.rotary_embs[key] = get_rope(config, head_dim_of(config), layer_type,
                                             max_model_len=self.max_model_len)
        return self.rotary_embs[key]

    def _copy_aux(self, aux: torch.Tensor, index: int, hidden_states: torch.Tensor,
                  residual: torch.Tensor | None) -> None:
        """Copy the stream entering layer ``index`` into its column blocks of ``aux``."""
        num_tokens, hidden = hidden_states.shape
        if num_tokens > aux.shape[0]:
            raise ValueError(f"{num_tokens} tokens in a step, but the auxiliary hidden-state "
                             f"buffer holds {aux.shape[0]}")
        stream = hidden_states if residual is None else hidden_states + residual
        for slot, layer in enumerate(self.aux_hidden_state_layers):
            if layer == index:
                aux[:num_tokens, slot * hidden : (slot + 1) * hidden].copy_(stream)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        assert self.embed_tokens is not None, "only the first pipeline stage embeds"
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer of this stage
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The last stage returns the normed hidden states ``[num_tokens, hidden_size]``, the
        others what the next stage takes (``intermediate`` is the previous stage's)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        if self.embed_tokens is not None:
            hidden_states = self.embed(input_ids)  # [num_tokens, hidden_size]
            residual = None
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous one's"
            hidden_states, residual = intermediate.hidden_states, intermediate.residual
        aux = self.aux_hidden_states
        for (index, layer), kv_cache in zip(self.layers.items(), kv_caches):
            if aux is not None:
                self._copy_aux(aux, int(index), hidden_states, residual)
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        if self.norm is None:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; the interface the model runner calls.

    ``sliding_window`` is the checkpoint's attention window (the largest over layers;
    ``None``: full attention everywhere); ``model.sliding_windows`` holds each layer's window
    as run. ``max_model_len`` is the engine's context length (``None``: the config's);
    ``quant_config`` the checkpoint's quantization (``None``: dense weights).
    """

    # The runner may hand load_weights lazy checkpoint tensors (octavo.model_executor.layers.
    # weights.CheckpointTensor): each rank reads only its part of a weight.
    lazy_weights = True
    # Built for tensor and pipeline parallelism (a parallel= argument; IntermediateTensors).
    supports_parallel = True
    # Takes the engine's context length (a max_model_len= argument).
    accepts_max_model_len = True
    # Its linear layers take their weights and matmul from a quantization method (a
    # quant_config= argument; octavo.model_executor.layers.quantization).
    supports_quantization = True
    # The decoder body.
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: Any, attn_backend: AttentionBackend,
                 parallel: ParallelState | None = None,
                 quant_config: QuantizationConfig | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelState.single()
        self.config = config
        self.parallel = parallel
        self.options = self.decoder_options(config)
        windows = [w for w in layer_sliding_windows(config) if w is not None]
        self.sliding_window: int | None = max(windows) if windows else None
        # Read by make_mlp while the layers are built.
        self.quant_config = quant_config
        self.model = self.model_cls(config, self.options, attn_backend, parallel, self.make_mlp,
                                    quant_config, max_model_len)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # The LM head: the embedding itself when tied and on this stage, else its own weight.
        self.lm_head: VocabParallelEmbedding | None = None
        if parallel.ranks.is_last_stage:
            if self.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head = self.model.embed_tokens
            else:
                self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        """The architecture switches for ``config``; subclasses override."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def make_mlp(self, config: Any, layer_index: int, parallel: ParallelState) -> nn.Module:
        """Layer ``layer_index``'s feed-forward block; mixture-of-experts subclasses override."""
        return make_llama_mlp(config, self.options, parallel, self.quant_config,
                              f"model.layers.{layer_index}.mlp")

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # one per layer of this stage, the backend's layout
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:  # [num_tokens, hidden_size], after the final norm
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 ``[n, vocab_size]`` (matmul in the model dtype)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return compute_logits(hidden_states, self.lm_head)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (see :func:`load_hf_weights`)."""
        aliases: dict[str, str] = {}
        skip: set[str] = set()
        if self.tie_word_embeddings:
            if self.lm_head is not None and self.lm_head is not self.model.embed_tokens:
                aliases["model.embed_tokens.weight"] = "lm_head.weight"  # tied, another stage
            skip.add("lm_head.weight")
        load_hf_weights(self, weights, skip_names=skip, aliases=aliases,
                        elsewhere=self._on_other_stage)

    def _on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) not in self.model.layer_range
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None and not (
                self.tie_word_embeddings and self.lm_head is not None)
        if name.startswith("model.norm."):
            return self.model.norm is None
        if name.startswith("lm_head."):
            return self.lm_head is None
        return False


# Checkpoint buffers that hold no learned weight (rope tables some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# How many names an error message lists before summarising.
_MAX_LISTED = 20


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Loaded]],
    skip_names: Iterable[str] = (),
    aliases: dict[str, str] | None = None,
    elsewhere: Callable[[str], bool] | None = None,
) -> None:
    """Copy ``(name, tensor)`` pairs named as in the HF checkpoint into ``model``'s parameters.

    A name is either a parameter's own name, or ``<parent>.<shard>.<weight|bias>`` where
    ``<parent>`` holds a ``ColumnParallelLinear`` with that shard name (``...self_attn.k_proj.
    weight`` fills the ``k_proj`` shard of ``...self_attn.qkv_proj.weight``), or a name a module
    declares through ``checkpoint_weights()`` (checkpoint names relative to the module ->
    ``(parameter, shard)``: a ``FusedMoE``'s per-expert tensors). A merged layer's
    own name takes a fused checkpoint tensor holding all its shards in order (Phi-3's
    ``qkv_proj``, ``gate_up_proj``). Each parameter's
    ``weight_loader`` copies the part this rank holds (cast to the parameter's dtype and
    device); a tensor may be a lazy ``CheckpointTensor``. Names in ``skip_names`` and rope
    buffers are ignored; then ``aliases`` renames checkpoint names (a tied head on its own stage);
    ``elsewhere(name)`` says a tensor belongs to another pipeline stage (ignored here).

    Raises ``ValueError`` on a shape mismatch, and after the last tensor when any parameter
    (or merged shard) received no weight or any name matched nothing; the message lists them.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_owner: dict[str, tuple[str, str]] = {}  # "<parent>.<shard>" -> (layer path, shard)
    shards_of: dict[str, tuple[str, ...]] = {}  # merged parameter -> its shard names
    declared: dict[str, tuple[str, str]] = {}  # checkpoint name -> (parameter, shard)
    expected: set[tuple[str, str | None]] = set()
    # A quantization method may name a parameter differently from some checkpoints
    # (LinearMethod.checkpoint_aliases): layer path -> {checkpoint name: parameter name}.
    attr_aliases: dict[str, dict[str, str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if callable(getattr(module, "checkpoint_weights", None)):
            for relative, (attr, shard) in module.checkpoint_weights().items():
                declared[f"{path}.{relative}"] = (f"{path}.{attr}", shard)
                expected.add((f"{path}.{attr}", shard))
        method = getattr(module, "quant_method", None)
        if method is not None and method.checkpoint_aliases:
            attr_aliases[path] = method.checkpoint_aliases
        names = getattr(module, "shard_names", ())
        if isinstance(module, ColumnParallelLinear) and names:
            parent = path.rpartition(".")[0]
            for shard in names:
                shard_owner[f"{parent}.{shard}" if parent else shard] = (path, shard)
                expected.update((f"{path}.{attr}", shard) for attr, _ in module.named_parameters())
            shards_of.update((f"{path}.{attr}", names) for attr, _ in module.named_parameters())
    merged_params = {name for name, _ in expected}
    shared = _shared_parameter_names(model)
    expected.update((name, None) for name in params if name not in merged_params | shared)
    # Tensors a checkpoint may leave out (GPTQ's g_idx without act-order).
    expected = {key for key in expected if not layout_of(params[key[0]]).optional}

    skip = set(skip_names)
    aliases = aliases or {}
    loaded: set[tuple[str, str | None]] = set()
    unknown: list[str] = []
    for name, tensor in weights:
        if name in skip or name.endswith(_IGNORED_SUFFIXES):
            continue
        name = aliases.get(name, name)
        if elsewhere is not None and elsewhere(name):
            continue
        prefix, _, attr = name.rpartition(".")
        if name in declared:
            key = declared[name]
        elif prefix in shard_owner:
            path, shard = shard_owner[prefix]
            target = f"{path}.{attr_aliases.get(path, {}).get(attr, attr)}"
            if target not in params:
                unknown.append(name)
                continue
            key: tuple[str, str | None] = (target, shard)
        else:
            renamed = attr_aliases.get(prefix, {}).get(attr, attr)
            target = f"{prefix}.{renamed}" if prefix else renamed
            if target not in params:
                unknown.append(name)
                continue
            key = (target, None)
        param = params[key[0]]
        try:
            weight_loader_of(param)(param, tensor, key[1])
        except ValueError as exc:
            raise ValueError(f"checkpoint weight {name!r} into {key[0]}: {exc}") from None
        if key[1] is None and key[0] in shards_of:  # a fused tensor: every shard at once
            loaded.update((key[0], shard) for shard in shards_of[key[0]])
        else:
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


def _shared_parameter_names(model: nn.Module) -> set[str]:
    """Names under which an already-named parameter appears again (a tied LM head)."""
    seen: dict[int, str] = {}
    shared = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            shared.add(name)
        else:
            seen[id(param)] = name
    return shared


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


def head_dim_of(config: Any) -> int:
    """``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
