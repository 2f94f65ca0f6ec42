"""The contract between a model's attention layers and a backend's paged-attention kernels.

KV-cache layout (the default; a backend may choose another through ``get_kv_cache_shape``):
one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, index 0 = keys,
1 = values. Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its *slot* is ``block_id * block_size + offset``.

Every step is one flat batch of ``num_tokens`` new tokens from ``num_seqs`` sequences: a
sequence contributes ``query_len`` new tokens (a whole prompt, a prefill chunk, or one decode
token) after ``seq_len - query_len`` tokens already in its cache (a cached prefix or earlier
chunks). Attention is causal: new token ``i`` of a sequence sees cache positions
``< seq_len - query_len + i + 1``. The cache is allocated uninitialised: a kernel must never
let a slot at or past ``seq_len`` influence its result (mask loads, or zero padded values
before a matmul: 0 * NaN is NaN).

Two per-layer options change what a new token sees and how its scores are formed:

- ``sliding_window = W``: the token at position ``p`` sees only the ``W`` positions
  ``p - W + 1 .. p`` (Hugging Face's ``kv_idx > q_idx - sliding_window``). Kernels must not
  read cache positions before a sequence's window: the KV cache manager may have given those
  blocks to another request (their ids stay in the block table).
- ``logits_soft_cap = c``: every score becomes ``c * tanh(scale * q.k / c)`` before the
  causal/window mask and the softmax (Gemma 2).

A backend declares which it implements (``AttentionBackend.supports_sliding_window`` /
``supports_logits_soft_cap``, and the same in its ``BackendCapabilities``); the model layer
refuses a backend that lacks one it needs (``check_attention_options``).

fp8 KV cache (``--kv-cache-dtype fp8``): the cache tensors are ``torch.float8_e4m3fn`` and hold
``key / k_scale`` and ``value / v_scale``, saturated to +-448; ``k_scale``/``v_scale`` are
per-tensor, per-layer floats on the ``AttentionImpl`` (1.0 unless set). A kernel reading the
cache multiplies by them. Every impl must accept such a cache when its backend lists "fp8" in
``BackendCapabilities.kv_cache_dtypes``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of the flat batch, built by the model runner, read by kernels."""

    # Number of sequences in the step.
    num_seqs: int
    # Number of new tokens in the step (sum of query lengths).
    num_tokens: int
    # [num_tokens] int64: cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: offsets of each sequence's new tokens in the flat batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached + new).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: block ids of each sequence, padded with 0.
    block_tables: torch.Tensor
    # Longest query length in the step (1 for a pure decode step).
    max_query_len: int
    # Longest context length in the step.
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens, for kernels that loop on the host.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence adds exactly one token this step."""
        return self.max_query_len == 1

    @classmethod
    def from_lists(
        cls,
        slot_mapping: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]] | torch.Tensor,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """A step described by host lists (tests, benchmarks, reference runs; the model runner
        builds its own with non-blocking copies). Block tables given as lists are padded with
        block 0 to the widest one."""
        if not isinstance(block_tables, torch.Tensor):
            width = max((len(t) for t in block_tables), default=0)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                        dtype=torch.int32)
        query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        return cls(
            num_seqs=len(seq_lens),
            num_tokens=len(slot_mapping),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device=device, dtype=torch.int32),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=list(query_start_loc),
            seq_lens_cpu=list(seq_lens),
        )

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The same step with its tensors on ``device``."""
        return AttentionMetadata(
            num_seqs=self.num_seqs,
            num_tokens=self.num_tokens,
            slot_mapping=self.slot_mapping.to(device),
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=list(self.query_start_loc_cpu),
            seq_lens_cpu=list(self.seq_lens_cpu),
        )


class Rotation(Protocol):
    """What ``AttentionImpl.forward_rotary`` needs of a rotary position embedding
    (``octavo.model_executor.layers.rotary.RotaryEmbedding`` is one)."""

    def __call__(self, positions: torch.Tensor, query: torch.Tensor,
                 key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``(query, key)`` (``[num_tokens, heads, head_dim]`` each) by the tokens'
        positions; the inputs are left untouched."""

    def neox_table(self) -> torch.Tensor | None:
        """The ``[max_positions, head_dim]`` float32 ``cos | sin`` table when the rotation is
        the "neox" halves over every dimension of a head (what a backend's fused kernel
        computes); ``None`` when it is anything else (a partial rotation)."""


class AttentionImpl(ABC):
    """One attention layer's kernel: writes new K/V into the paged cache, then attends.

    Implementations must write the K/V of *all* new tokens of the step before reading the
    cache: a sequence may use prefix blocks that another sequence in the same step fills.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        if sliding_window is not None and (
                not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(
                f"sliding_window must be None or a positive int, got {sliding_window!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be None or > 0, got {logits_soft_cap!r}")
        # Keys a new token sees (itself included); None: every earlier position.
        self.sliding_window = sliding_window
        # Scores become cap * tanh(score / cap); None: no cap.
        self.logits_soft_cap = logits_soft_cap
        # Per-tensor scales of an fp8 KV cache (stored = x / scale); unused by other caches.
        self.k_scale = 1.0
        self.v_scale = 1.0

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # backend layout, e.g. [2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store ``key``/``value`` at ``metadata.slot_mapping`` and return causal attention."""

    def forward_rotary(
        self,
        positions: torch.Tensor,  # [num_tokens]
        rotary: Rotation,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], not rotated yet
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not rotated yet
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """``forward`` of ``rotary``'s rotation of ``query`` and ``key``. This default rotates,
        then calls ``forward``; a backend may do both in fewer kernels (the Triton one rotates
        and writes the cache in one launch), with the same result."""
        query, key = rotary(positions, query, key)
        return self.forward(query, key, value, kv_cache, metadata)


class AttentionBackend(ABC):
    """A family of attention kernels for one device; returned by ``octavo_attention_backend``."""

    #: Short name shown in logs, e.g. ``"cpu-torch"`` or ``"triton"``.
    name: str = "unnamed"
    #: Whether ``make_impl`` takes ``sliding_window`` (and the kernels honour it).
    supports_sliding_window: bool = False
    #: Whether ``make_impl`` takes ``logits_soft_cap`` (and the kernels honour it).
    supports_logits_soft_cap: bool = False
    #: Dimension of ``get_kv_cache_shape`` that indexes blocks (what the KV block mover gathers
    #: and scatters on: swaps and copies-on-write). A backend with another layout changes both.
    kv_cache_block_dim: int = 1

    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (default: ``[2, blocks, block_size, kv_heads, dim]``)."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def supported_head_dims(self) -> tuple[int, ...] | None:
        """Head dimensions the kernels handle, or ``None`` for any."""
        return None

    @abstractmethod
    def make_impl(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> AttentionImpl:
        """Build the kernel object for one attention layer.

        ``sliding_window`` and ``logits_soft_cap`` (see the module docstring) are passed only
        when set, and only to backends that declare support for them, so a backend that
        supports neither may take just the four positional arguments.
        """


def check_attention_options(
    backend: AttentionBackend, sliding_window: int | None, logits_soft_cap: float | None
) -> dict[str, int | float]:
    """The options to pass ``backend.make_impl``; raises ``ValueError`` (one line saying what
    to do) when the backend lacks one the layer needs."""
    options: dict[str, int | float] = {}
    if sliding_window is not None:
        if not backend.supports_sliding_window:
            raise ValueError(
                f"attention backend {backend.name!r} does not implement sliding-window attention "
                f"(window {sliding_window}), which this model uses beyond its window: lower "
                f"--max-model-len to {sliding_window} or use a backend that supports it"
            )
        options["sliding_window"] = sliding_window
    if logits_soft_cap is not None:
        if not backend.supports_logits_soft_cap:
            raise ValueError(
                f"attention backend {backend.name!r} does not implement attention logit "
                f"soft-capping (cap {logits_soft_cap}), which this model needs: use a backend "
                "that supports it"
            )
        options["logits_soft_cap"] = logits_soft_cap
    return options
