"""``GrammarMaskUpload``: a step's grammar bitmask to the logits' device, for every sampling
path (the greedy argmax, the sampler, speculative verification).

Every step with structured outputs brings the token bitmask of its constrained rows (about
1.5 MB for 256 rows of a 49k vocabulary). Pinning it anew each step (``tensor.pin_memory()``:
an allocation from torch's pinned pool and a copy) and uploading the row ids the same way sat
on the chain "sampled tokens -> host -> masks -> device -> sample" of every constrained step.
Here the rows are copied once, straight from the engine core's buffer, into one of two pinned
staging buffers kept for the runner's life, and uploaded from there; when the step's rows are
exactly the rows it samples, in order (every sampling request constrained: the common case of
a JSON-constrained batch), no row ids are uploaded and the mask applies to the whole logits in
place, without the gather and scatter of rows. The sampler's path (``SamplingMetadata``) and
speculative verification (a request's logits row among its draft rows: ``logits_rows``) take
the same staged masks, instead of pinning the rows anew each step.

When the engine core's mask buffers are shared memory this process maps (``SharedMasks``:
the grammar process or the in-thread manager fills them), the runner page-locks them once
(``use_host_buffers``) and a step whose rows are all sampled in order is uploaded straight
from there, without the staging copy (1.5 MB a step at 256 rows). That is safe for the same
reason two buffers are enough (``octavo.messages.shared_masks``): a buffer is refilled only
after the engine core has the results of the step after the one that read it, and a step's
results come back after its copies ran.

On other devices than CUDA (and HIP, which torch calls ``cuda``) the host tensors are used as
they are: those devices compute as they are called, so there is nothing to stage.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from octavo.messages import GrammarBitmask
from octavo.sample.metadata import DeviceGrammarMasks
from octavo.transfer import register_host_memory, unregister_host_memory

__all__ = ["DeviceGrammarMasks", "GrammarMaskUpload"]


@dataclass(slots=True)
class _Staging:
    """One pinned host buffer pair and the event after the copies that read it."""

    bitmask: torch.Tensor  # [rows, words] int32, pinned
    row_ids: torch.Tensor  # [rows] int64, pinned
    copied: torch.cuda.Event | None = None


class GrammarMaskUpload:
    """See the module docstring. One per model runner; not thread-safe (the runner's
    thread)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        """``max_rows``: the most rows a step samples (the staging buffers' size; a larger
        step grows them)."""
        self.device = device
        self.max_rows = max_rows
        # Two, used in turn: a step's copy may still be queued when the next step stages.
        self._staging: list[_Staging] = []
        self._next = 0
        # The page-locked buffers rows may be uploaded from directly: [start, end) addresses.
        self._locked: tuple[int, int] | None = None

    def use_host_buffers(self, buffers: np.ndarray) -> bool:
        """Page-lock ``buffers`` (the engine core's shared mask buffers, mapped in this
        process) so that steps whose rows lie there upload without staging. Kept locked, and
        mapped, until this object goes. False where nothing is locked (not CUDA, refused by
        the driver, or buffers already taken): uploads then stage as before."""
        if self.device.type != "cuda" or self._locked is not None:
            return False
        if not register_host_memory(buffers):
            return False
        start = buffers.ctypes.data
        self._locked = (start, start + buffers.nbytes)
        # Holds the buffers (so their mapping stays) until it unregisters them.
        weakref.finalize(self, unregister_host_memory, buffers)
        return True

    def _in_locked(self, data: np.ndarray) -> bool:
        """Whether ``data`` lies in the page-locked buffers (their views are writeable;
        ``torch.from_numpy`` of a read-only array would warn)."""
        if self._locked is None or not data.flags.writeable:
            return False
        start = data.ctypes.data
        return self._locked[0] <= start and start + data.nbytes <= self._locked[1]

    def upload(self, bitmask: GrammarBitmask, sampled_req_ids: list[str],
               logits_rows: list[int] | None = None) -> DeviceGrammarMasks | None:
        """The rows of ``bitmask`` whose request samples in this step, for logits row
        ``sampled_req_ids.index(req_id)`` (or that index of ``logits_rows``, when a request's
        logits row is not its place among the sampled requests: speculative verification's
        draft rows), on the device (copies queued, not waited for). None when none of its
        requests samples here. ``bitmask.data`` is read before this returns, never after."""
        data = np.frombuffer(bitmask.data, dtype="<i4").reshape(len(bitmask.req_ids),
                                                                bitmask.num_words)
        keep: list[int] | None = None
        rows: list[int] | None = None
        if logits_rows is not None or bitmask.req_ids != sampled_req_ids:
            row_of = dict(zip(sampled_req_ids,
                              range(len(sampled_req_ids)) if logits_rows is None else logits_rows,
                              strict=True))
            keep = [i for i, req_id in enumerate(bitmask.req_ids) if req_id in row_of]
            if not keep:
                return None
            rows = [row_of[bitmask.req_ids[i]] for i in keep]
        if self.device.type != "cuda":
            return self._on_host(data, keep, rows)
        num_rows = len(bitmask.req_ids) if keep is None else len(keep)
        if keep is None and self._in_locked(data):
            return DeviceGrammarMasks(
                row_ids=None, bitmask=torch.from_numpy(data).to(self.device, non_blocking=True))
        staging = self._staging_for(num_rows, bitmask.num_words)
        host_masks = staging.bitmask[:num_rows]
        if keep is None:
            np.copyto(host_masks.numpy(), data)
        else:
            np.take(data, keep, axis=0, out=host_masks.numpy())
        row_ids = None
        if rows is not None:
            host_rows = staging.row_ids[:num_rows]
            host_rows.numpy()[:] = rows
            row_ids = host_rows.to(self.device, non_blocking=True)
        device_masks = host_masks.to(self.device, non_blocking=True)
        staging.copied = torch.cuda.Event()
        staging.copied.record()
        return DeviceGrammarMasks(row_ids=row_ids, bitmask=device_masks)

    def _on_host(self, data: np.ndarray, keep: list[int] | None,
                 rows: list[int] | None) -> DeviceGrammarMasks:
        if keep is not None:
            masks = torch.from_numpy(data[keep])
        else:  # the engine core's buffer is used as it is; a received message's is copied
            masks = torch.from_numpy(data if data.flags.writeable else data.copy())
        row_ids = None if rows is None else torch.from_numpy(np.array(rows, dtype=np.int64))
        return DeviceGrammarMasks(row_ids=None if row_ids is None else row_ids.to(self.device),
                                  bitmask=masks.to(self.device))

    def _staging_for(self, num_rows: int, num_words: int) -> _Staging:
        """The next staging buffers, at least ``num_rows`` x ``num_words``, once the copies
        that last read them are done (two steps back: in practice long done)."""
        if (not self._staging or self._staging[0].bitmask.shape[0] < num_rows
                or self._staging[0].bitmask.shape[1] != num_words):
            rows = max(num_rows, self.max_rows)
            for staging in self._staging:  # the old buffers may still be read by a copy
                if staging.copied is not None:
                    staging.copied.synchronize()
            self._staging = [
                _Staging(torch.empty(rows, num_words, dtype=torch.int32, pin_memory=True),
                         torch.empty(rows, dtype=torch.int64, pin_memory=True))
                for _ in range(2)]
            self._next = 0
        staging = self._staging[self._next]
        self._next = 1 - self._next
        if staging.copied is not None:
            staging.copied.synchronize()
            staging.copied = None
        return staging
