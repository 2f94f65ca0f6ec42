"""Batched LoRA inside the linear layers: every token row adds its request's adapter.

Each adapted layer (``ColumnParallelLinear`` with its shards, ``RowParallelLinear``) gets a
``LoRALinear`` holding ``max_loras`` slots of weights:

- ``lora_a``: ``[max_loras, num_shards * max_rank, local_in]``
- ``lora_b``: ``[max_loras, local_out, num_shards * max_rank]``, the adapter's scale folded in,

shard ``i`` (q/k/v, gate/up) using ranks ``[i * max_rank, i * max_rank + r)`` of A and only
its own output rows of B (B is block-diagonal over the shards), zeros elsewhere, so one
shrink ``h = x A^T`` and one expand ``y += h B^T`` serve every shard. With tensor parallelism
A and B are split like the base weight: a column-parallel layer keeps its rank's output rows
of B (A whole); a row-parallel layer its rank's input columns of A (B whole), and its partial
``(x_r A_r^T) B^T`` is summed with the base partial products by the layer's one all-reduce
(the sum over ranks of ``x_r A_r^T`` is ``x A^T``, and B is linear).

Which rows use which slot is one ``LoRAMapping`` per step, shared by every layer through the
manager's ``LoRABatch`` (set before the forward, cleared after): flat token indices grouped
by slot. Rows of no adapter are in no group and get nothing added. The torch path below is
the reference and the CPU path; on a GPU the Triton kernels of
``octavo.kernels.triton.lora`` do the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from octavo.transfer import host_to_device


@dataclass(slots=True)
class LoRAMapping:
    """One step's rows by adapter slot."""

    # Flat token indices (rows of the step's batch), grouped by slot: [num_lora_tokens] int64.
    token_indices: torch.Tensor
    # Slot of each group, on the host and on the device ([num_groups] int32).
    group_slots: list[int]
    group_slots_dev: torch.Tensor
    # Group g is token_indices[group_starts[g] : group_starts[g + 1]] (host and device,
    # [num_groups + 1] int32).
    group_starts: list[int]
    group_starts_dev: torch.Tensor
    # Most tokens in one group (the kernels' grid).
    max_group_size: int

    @classmethod
    def from_requests(cls, slots: Sequence[int], num_tokens: Sequence[int],
                      device: torch.device) -> LoRAMapping | None:
        """The mapping of a step whose requests (in batch order) take ``num_tokens`` rows
        each and use ``slots`` (-1: no adapter); ``None`` when no row uses one."""
        by_slot: dict[int, list[int]] = {}
        start = 0
        for slot, count in zip(slots, num_tokens, strict=True):
            if slot >= 0:
                by_slot.setdefault(slot, []).extend(range(start, start + count))
            start += count
        if not by_slot:
            return None
        group_slots = sorted(by_slot)
        indices: list[int] = []
        starts = [0]
        for slot in group_slots:
            indices.extend(by_slot[slot])
            starts.append(len(indices))
        flat = host_to_device(torch.tensor(indices + group_slots + starts, dtype=torch.long),
                              device)
        num, groups = len(indices), len(group_slots)
        return cls(
            token_indices=flat[:num],
            group_slots=group_slots,
            group_slots_dev=flat[num:num + groups].to(torch.int32),
            group_starts=starts,
            group_starts_dev=flat[num + groups:].to(torch.int32),
            max_group_size=max(b - a for a, b in zip(starts, starts[1:])),
        )


class LoRABatch:
    """The step's ``LoRAMapping``, shared by every ``LoRALinear`` of a model.

    ``mapping`` is ``None`` outside a step that has LoRA rows: the layers then add nothing.
    CUDA graphs of LoRA steps capture a ``LoRAGraphInputs`` mapping instead.
    """

    def __init__(self, use_kernels: bool) -> None:
        self.mapping: LoRAMapping | None = None
        # Run the Triton kernels (GPU) instead of the torch reference.
        self.use_kernels = use_kernels
        self.kernel = None
        if use_kernels:
            from octavo.kernels.triton.lora import lora_shrink_expand

            self.kernel = lora_shrink_expand


class LoRAGraphInputs:
    """A ``LoRAMapping`` in persistent device buffers, for CUDA graphs of LoRA steps.

    A graph captured under ``capturing(num_tokens)`` launches the kernels with a grid for
    every slot (``max_loras`` groups) and ``num_tokens`` rows per group; before each replay
    ``stage()`` copies the step's real mapping into the buffers, and the groups it does not
    use are left empty (their programs exit at once), so the captured launches add exactly
    what the step's mapping asks for. The host lists of the captured mapping describe the
    capture only (graphs run the kernels, which read the device buffers).
    """

    def __init__(self, batch: LoRABatch, max_loras: int, max_tokens: int,
                 device: torch.device) -> None:
        if batch.kernel is None:
            raise ValueError("LoRA graph inputs need the LoRA kernels (a GPU device)")
        self.batch = batch
        self.max_loras = max_loras
        self.token_indices = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.group_slots = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.group_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)

    @property
    def step_has_lora(self) -> bool:
        """Whether the step being run has rows with an adapter (``LoRABatch.mapping``)."""
        return self.batch.mapping is not None

    @contextmanager
    def capturing(self, num_tokens: int) -> Iterator[None]:
        """Make the layers launch the kernels on the buffers (every group empty) while a
        graph of ``num_tokens`` rows is captured."""
        self.group_starts.zero_()
        self.batch.mapping = LoRAMapping(
            token_indices=self.token_indices[:num_tokens],
            group_slots=list(range(self.max_loras)),
            group_slots_dev=self.group_slots,
            group_starts=[0] * (self.max_loras + 1),
            group_starts_dev=self.group_starts,
            max_group_size=num_tokens,
        )
        try:
            yield
        finally:
            self.batch.mapping = None

    def stage(self) -> None:
        """Copy the step's mapping into the buffers (before replaying a LoRA graph)."""
        mapping = self.batch.mapping
        assert mapping is not None, "stage() needs a step with LoRA rows"
        rows, groups = mapping.token_indices.shape[0], len(mapping.group_slots)
        assert groups <= self.max_loras and rows <= self.token_indices.shape[0]
        self.token_indices[:rows].copy_(mapping.token_indices, non_blocking=True)
        self.group_slots[:groups].copy_(mapping.group_slots_dev, non_blocking=True)
        self.group_starts[: groups + 1].copy_(mapping.group_starts_dev, non_blocking=True)
        self.group_starts[groups + 1 :].fill_(rows)


def lora_torch(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor,
               lora_b: torch.Tensor, mapping: LoRAMapping) -> None:
    """Reference: ``out[t] += (x[t] @ A[s]^T) @ B[s]^T`` for each row ``t`` of slot ``s``.

    ``x [num_tokens, in]``, ``out [num_tokens, out]`` (updated in place),
    ``lora_a [slots, R, in]``, ``lora_b [slots, out, R]``.
    """
    starts = mapping.group_starts
    for group, slot in enumerate(mapping.group_slots):
        rows = mapping.token_indices[starts[group]:starts[group + 1]]
        shrunk = x.index_select(0, rows) @ lora_a[slot].t()  # [rows, R]
        out.index_add_(0, rows, (shrunk @ lora_b[slot].t()).to(out.dtype))  # [rows, out]


class LoRALinear(nn.Module):
    """The LoRA slots of one linear layer (see the module docstring for the layout).

    :param shard_rows: per shard, (first local output row, local rows, first row of this
        rank's part in the checkpoint tensor); one entry for a layer of one projection.
    :param input_range: (first input column, columns) of this rank's part of A (a
        row-parallel layer's split input); ``None``: A is whole.
    """

    def __init__(self, batch: LoRABatch, max_loras: int, max_rank: int, local_in: int,
                 shard_rows: Sequence[tuple[int, int, int]],
                 input_range: tuple[int, int] | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.batch = batch
        self.max_rank = max_rank
        self.shard_rows = tuple(shard_rows)
        self.input_range = input_range
        local_out = sum(rows for _, rows, _ in self.shard_rows)
        total_rank = len(self.shard_rows) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, total_rank, local_in,
                                                   dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, local_out, total_rank,
                                                   dtype=dtype, device=device), persistent=False)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_shard(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor,
                  scale: float) -> None:
        """Copy one projection's ``A [r, in]`` and ``B [out, r]`` (whole, as in the
        checkpoint) into ``slot``: this rank's part, B scaled."""
        rank = a.shape[0]
        first_rank = shard * self.max_rank
        if self.input_range is not None:
            start, size = self.input_range
            a = a[:, start:start + size]
        offset, rows, source = self.shard_rows[shard]
        b = b[source:source + rows].float() * scale
        self.lora_a[slot, first_rank:first_rank + rank].copy_(a)
        self.lora_b[slot, offset:offset + rows, first_rank:first_rank + rank].copy_(b)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += LoRA(x)`` for the step's adapter rows (nothing outside a LoRA step)."""
        mapping = self.batch.mapping
        if mapping is None:
            return
        if self.batch.kernel is not None:
            self.batch.kernel(x, out, self.lora_a, self.lora_b, mapping.token_indices,
                              mapping.group_slots_dev, mapping.group_starts_dev,
                              len(mapping.group_slots), mapping.max_group_size)
        else:
            lora_torch(x, out, self.lora_a, self.lora_b, mapping)

    def extra_repr(self) -> str:
        slots, rank, local_in = self.lora_a.shape
        return f"slots={slots}, rank={rank}, in={local_in}, out={self.lora_b.shape[1]}"
