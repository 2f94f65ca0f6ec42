"""The ``"triton"`` attention backend: ``AttentionBackend``/``AttentionImpl`` on the Triton kernels.

``TritonAttentionImpl.forward`` writes the K/V of every new token first (a sequence may read
prefix blocks another sequence fills in the same step; ``forward_rotary`` rotates the keys
and writes them in the same launch, ``apply_rotary_write_kv``), then:

- pure decode step (every query length 1): ``decode_attention`` (flash-decoding, split-K);
- any other step, mixed ones included: ``prefill_attention`` for all rows in one launch. Its
  decode rows get one program per (sequence, KV head) over their whole context, which is fine
  next to a prefill that dominates the step; splitting them out would cost a second launch
  and a gather/scatter of rows.

Device tuning lives in ``TritonLaunchConfig``; a ROCm backend passes its own (e.g. fewer warps
for 64-wide wavefronts) to ``TritonAttentionBackend(config)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from octavo import envs
from octavo.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata, Rotation
from octavo.kernels.triton.cache_write import interpreting, write_kv_cache
from octavo.kernels.triton.decode_attention import decode_attention
from octavo.kernels.triton.prefill_attention import prefill_attention
from octavo.kernels.triton.rotary import apply_rotary_write_kv
from octavo.kernels.triton_support import TRITON_HEAD_DIMS

#: Head dimensions the backend accepts (defined, importable without Triton, in triton_support).
SUPPORTED_HEAD_DIMS = TRITON_HEAD_DIMS
_DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True, slots=True)
class TritonLaunchConfig:
    """Launch parameters of the Triton attention kernels (defaults suit NVIDIA H100)."""

    # Prefill tile rows: query tokens x query heads per KV head (padded to a power of two).
    # Power of two, >= 16 (tl.dot's smallest M).
    prefill_block_m: int = 64
    # Keys per prefill loop step (halved for head dims above 128); power of two, >= 16.
    prefill_block_n: int = 64
    # Warps (NVIDIA: 32 threads, AMD: 64-thread wavefronts) per prefill program.
    prefill_num_warps: int = 4
    # Software-pipelining stages of the prefill key loop.
    prefill_num_stages: int = 2
    # Keys per decode loop step; power of two, >= 16.
    decode_block_n: int = 64
    # Most keys per decode partition (first flash-decoding kernel); a multiple of
    # decode_block_n. Contexts longer than this are always split (plus the reduce kernel).
    decode_partition_size: int = 512
    # Decode batches of at least this many (sequence, KV head) programs are not split along
    # the context: they fill the GPU already (H100: 132 SMs), and the split would only add
    # empty programs and the reduce kernel. Smaller batches are split into enough partitions
    # to make about this many programs (each sequence's spans cut from its own length;
    # octavo.kernels.triton.decode_attention). None: split by decode_partition_size only.
    decode_unsplit_min_programs: int | None = 256
    # Keys per partition when a wide batch of fewer than decode_fill_programs programs is
    # split after all: more programs in flight for the same bytes, plus the reduce kernel
    # (H100, 229 sequences of a 0.5B model, 2 KV heads: 458 programs, 68.6-77.2 -> 63.6 us;
    # bench_decode_attention.py). A multiple of decode_block_n; None: never.
    decode_wide_batch_span: int | None = 768
    # Batches of at least this many (sequence, KV head) programs are never split (H100: an
    # 8B model's 226 sequences x 8 KV heads ran at 94 % of the KV-read floor unsplit, and
    # slower in spans).
    decode_fill_programs: int | None = 1024
    # Warps per decode program (both decode kernels).
    decode_num_warps: int = 4
    # Software-pipelining stages of the decode key loop.
    decode_num_stages: int = 2
    # Warps per program of the KV-cache write kernel (one program per token).
    cache_write_num_warps: int = 4
    # tl.dot input_precision for float32 inputs: "ieee" (exact, portable), "tf32" (NVIDIA
    # tensor cores, ~1e-3 relative error), "tf32x3". Ignored for 16-bit inputs.
    fp32_dot_precision: str = "ieee"

    def __post_init__(self) -> None:
        for name in ("prefill_block_m", "prefill_block_n", "decode_block_n"):
            value = getattr(self, name)
            if not _is_power_of_two(value) or value < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("prefill_num_warps", "decode_num_warps", "cache_write_num_warps"):
            if not _is_power_of_two(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")
        for name in ("prefill_num_stages", "decode_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_partition_size % self.decode_block_n != 0:
            raise ValueError(
                f"decode_partition_size ({self.decode_partition_size}) must be a multiple of "
                f"decode_block_n ({self.decode_block_n})"
            )
        if self.decode_unsplit_min_programs is not None and self.decode_unsplit_min_programs < 1:
            raise ValueError(
                "decode_unsplit_min_programs must be None or >= 1, "
                f"got {self.decode_unsplit_min_programs}"
            )
        span = self.decode_wide_batch_span
        if span is not None and (span < self.decode_block_n or span % self.decode_block_n):
            raise ValueError(
                f"decode_wide_batch_span ({span}) must be None or a positive multiple of "
                f"decode_block_n ({self.decode_block_n})"
            )
        if self.fp32_dot_precision not in _DOT_PRECISIONS:
            raise ValueError(
                f"fp32_dot_precision must be one of {_DOT_PRECISIONS}, "
                f"got {self.fp32_dot_precision!r}"
            )


class TritonAttentionImpl(AttentionImpl):
    """One attention layer on the Triton kernels (see the module docstring for the dispatch)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        config: TritonLaunchConfig | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                         logits_soft_cap)
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head_dim {head_dim} is not supported by the triton backend; "
                f"choose one of {SUPPORTED_HEAD_DIMS}"
            )
        self.config = config or TritonLaunchConfig()
        # Whether forward_rotary takes the one-launch rotation and cache write.
        self.rotary_cache_write = envs.rotary_cache_write()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store ``key``/``value`` at ``metadata.slot_mapping`` and return causal attention."""
        if query.device.type == "cpu" and not interpreting():
            raise ValueError(
                "the triton attention backend got CPU tensors; it needs a GPU device, "
                "or TRITON_INTERPRET=1 set before Triton is imported (tests only)"
            )
        # Scales apply to an fp8 cache only (the kernels ignore them for other caches).
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, k_scale=self.k_scale,
                       v_scale=self.v_scale, num_warps=self.config.cache_write_num_warps)
        return self._attend(query, kv_cache, metadata)

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
        """The rotation and the cache write in one launch (``apply_rotary_write_kv``) where the
        rotation is whole-head neox and the cache has the keys' dtype (and
        ``OCTAVO_ROTARY_CACHE_WRITE`` is not ``0``); else the default (rotate, then
        ``forward``)."""
        table = rotary.neox_table() if self.rotary_cache_write else None
        if table is None or kv_cache.dtype != key.dtype or (not query.is_cuda
                                                              and not interpreting()):
            return super().forward_rotary(positions, rotary, query, key, value, kv_cache,
                                          metadata)
        query = apply_rotary_write_kv(positions, query, key, value, table, kv_cache,
                                      metadata.slot_mapping)
        return self._attend(query, kv_cache, metadata)

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Causal attention of ``query`` over the cache, this step's keys and values in it."""
        cfg = self.config
        k_scale, v_scale = self.k_scale, self.v_scale
        if metadata.is_pure_decode:
            return decode_attention(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                metadata.max_seq_len,
                self.scale,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                k_scale=k_scale,
                v_scale=v_scale,
                block_n=cfg.decode_block_n,
                partition_size=cfg.decode_partition_size,
                unsplit_min_programs=cfg.decode_unsplit_min_programs,
                wide_batch_span=cfg.decode_wide_batch_span,
                fill_programs=cfg.decode_fill_programs,
                num_warps=cfg.decode_num_warps,
                num_stages=cfg.decode_num_stages,
                fp32_dot_precision=cfg.fp32_dot_precision,
            )
        return prefill_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            block_m=cfg.prefill_block_m,
            block_n=cfg.prefill_block_n,
            num_warps=cfg.prefill_num_warps,
            num_stages=cfg.prefill_num_stages,
            fp32_dot_precision=cfg.fp32_dot_precision,
        )


class TritonAttentionBackend(AttentionBackend):
    """Portable Triton paged attention (NVIDIA and AMD GPUs; CPU under ``TRITON_INTERPRET=1``).

    Uses the default cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    name = "triton"
    supports_sliding_window = True
    supports_logits_soft_cap = True

    def __init__(self, config: TritonLaunchConfig | None = None) -> None:
        self.config = config or TritonLaunchConfig()

    def supported_head_dims(self) -> tuple[int, ...]:
        return SUPPORTED_HEAD_DIMS

    def make_impl(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
        sliding_window: int | None = None, logits_soft_cap: float | None = None,
    ) -> TritonAttentionImpl:
        return TritonAttentionImpl(num_heads, num_kv_heads, head_dim, scale, self.config,
                                   sliding_window, logits_soft_cap)

    def __repr__(self) -> str:
        return f"TritonAttentionBackend({asdict(self.config)})"
