"""Moving whole KV blocks: device -> host (swap out), host -> device (swap in), device ->
device (copy-on-write of a shared block).

The scheduler decides the moves (``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_copy`` /
``blocks_to_swap_in``); every worker makes them on its own device and in its own cache tensors
(its layers, its share of the KV heads) before the step's forward, in that order. A backend
provides its mover through the ``octavo_kv_block_mover`` hook (a plugin can replace it);
``TorchKVBlockMover`` is the default every built-in backend uses.

Batched: one gather and one scatter per layer per step, whatever the number of blocks, never
one copy per block. On a GPU the host pool is pinned and the copies do not make the host wait
for queued device work: a swap-out gathers the blocks on the device and starts one
non-blocking copy into pinned staging memory; the staging is written into the host pool when
the copy is known to be done (at the latest before the next swap-in reads the pool).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from octavo.transfer import host_to_device

logger = logging.getLogger(__name__)


class KVBlockMover(Protocol):
    """Moves KV blocks between one worker's device cache and its host pool.

    Each ``pairs`` argument is a ``(source block id, destination block id)`` list; the caches
    are the worker's per-layer tensors (device: ``[..., num_blocks, ...]`` with the blocks on
    the attention backend's ``kv_cache_block_dim``; host: the same shape with the host pool's
    block count). The moves of one call happen as if all sources were read before any
    destination is written.
    """

    def allocate_host_cache(self, device_caches: list[torch.Tensor],
                            num_blocks: int) -> list[torch.Tensor]:
        """The host pool: one tensor per layer like the device's, with ``num_blocks``."""
        ...

    def swap_out(self, device_caches: list[torch.Tensor], host_caches: list[torch.Tensor],
                 pairs: list[tuple[int, int]]) -> None: ...

    def swap_in(self, host_caches: list[torch.Tensor], device_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None: ...

    def copy(self, device_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None: ...


@dataclass(slots=True)
class _PendingHostWrite:
    """A swap-out whose device -> host copy may still be running."""

    # Host pool tensor per layer, and the pinned staging holding its gathered blocks.
    host_caches: list[torch.Tensor]
    staging: list[torch.Tensor]
    # Destination blocks in the host pool.
    host_block_ids: torch.Tensor
    # Recorded after the copies (None: already done, on the CPU).
    event: torch.cuda.Event | None


_FP8_DTYPES = tuple(getattr(torch, name) for name in
                    ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                    if hasattr(torch, name))


def _raw(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The caches to move: an fp8 cache (``--kv-cache-dtype fp8``) as its uint8 bytes, since
    torch has no CPU ``index_copy_`` for float8 (a move copies bytes, so nothing changes)."""
    return [c.view(torch.uint8) if c.dtype in _FP8_DTYPES else c for c in caches]


class TorchKVBlockMover:
    """``KVBlockMover`` with torch's ``index_select`` / ``index_copy_`` (any device, any cache
    dtype: fp8 caches move as bytes)."""

    def __init__(self, block_dim: int, device: torch.device) -> None:
        self.block_dim = block_dim
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._pending: list[_PendingHostWrite] = []

    def allocate_host_cache(self, device_caches: list[torch.Tensor],
                            num_blocks: int) -> list[torch.Tensor]:
        caches = []
        for cache in device_caches:
            shape = list(cache.shape)
            shape[self.block_dim] = num_blocks
            caches.append(torch.empty(shape, dtype=cache.dtype, pin_memory=self.pinned))
        return caches

    def _ids(self, ids: list[int], device: torch.device) -> torch.Tensor:
        return host_to_device(torch.tensor(ids, dtype=torch.long), device)

    def copy(self, device_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        both = self._ids([s for s, _ in pairs] + [d for _, d in pairs], self.device)
        src, dst = both[: len(pairs)], both[len(pairs):]
        for cache in _raw(device_caches):
            cache.index_copy_(self.block_dim, dst, cache.index_select(self.block_dim, src))

    def swap_out(self, device_caches: list[torch.Tensor], host_caches: list[torch.Tensor],
                 pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self.complete_host_writes(wait=False)
        device_caches, host_caches = _raw(device_caches), _raw(host_caches)
        src = self._ids([s for s, _ in pairs], self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        if not self.pinned:
            for cache, host in zip(device_caches, host_caches):
                host.index_copy_(self.block_dim, dst, cache.index_select(self.block_dim, src).cpu())
            return
        staging = []
        for cache in device_caches:
            gathered = cache.index_select(self.block_dim, src)
            pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            pinned.copy_(gathered, non_blocking=True)
            staging.append(pinned)
        event = torch.cuda.Event()
        event.record()
        self._pending.append(_PendingHostWrite(host_caches, staging, dst, event))

    def complete_host_writes(self, wait: bool = True) -> None:
        """Write finished swap-outs into the host pool, oldest first (``wait``: all of them,
        waiting for their copies; else only those already done)."""
        while self._pending:
            pending = self._pending[0]
            if pending.event is not None:
                if not wait and not pending.event.query():
                    return
                pending.event.synchronize()
            for host, staged in zip(pending.host_caches, pending.staging):
                host.index_copy_(self.block_dim, pending.host_block_ids, staged)
            self._pending.pop(0)

    def swap_in(self, host_caches: list[torch.Tensor], device_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self.complete_host_writes(wait=True)
        host_caches, device_caches = _raw(host_caches), _raw(device_caches)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = self._ids([d for _, d in pairs], self.device)
        for host, cache in zip(host_caches, device_caches):
            shape = list(host.shape)
            shape[self.block_dim] = len(pairs)
            staged = torch.empty(shape, dtype=host.dtype, pin_memory=self.pinned)
            torch.index_select(host, self.block_dim, src, out=staged)
            cache.index_copy_(self.block_dim, dst, staged.to(self.device, non_blocking=True))


def default_kv_block_mover(attn_backend, device: torch.device) -> TorchKVBlockMover:
    """The built-in backends' mover: blocks on ``attn_backend.kv_cache_block_dim``."""
    return TorchKVBlockMover(attn_backend.kv_cache_block_dim, device)
