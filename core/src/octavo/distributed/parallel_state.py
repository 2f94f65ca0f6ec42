"""Where this process sits in a model split over devices, and the collectives it runs.

A model runs on ``world_size = tensor_parallel_size x pipeline_parallel_size`` ranks, one per
device. Rank ``r`` is pipeline stage ``r // tp`` and tensor-parallel rank ``r % tp`` within its
stage: the ranks of one stage form a tensor-parallel group (they split every layer of the
stage), and the ranks with the same tensor-parallel rank form a pipeline group (they hand
hidden states from stage to stage).

``ParallelState`` is passed explicitly to the model and its layers (no process-wide global):
a layer keeps the state it was built with and calls its collectives. With one rank every
collective is the identity and no ``torch.distributed`` group exists, so the single-device
path pays nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a collective (and the rendezvous) may wait for a peer before failing: a rank that
# died must not hang the others forever.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True, slots=True)
class ParallelRanks:
    """This process's coordinates in the grid of ranks."""

    # Global rank, 0 .. world_size - 1.
    rank: int
    # Devices per layer (tensor parallelism) and stages (pipeline parallelism).
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank that returns the step's sampled tokens: the last stage's first TP rank."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def output_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    def tp_group_ranks(self) -> list[int]:
        start = self.pp_rank * self.tp_size
        return list(range(start, start + self.tp_size))

    def pp_group_ranks(self) -> list[int]:
        return [stage * self.tp_size + self.tp_rank for stage in range(self.pp_size)]


class ParallelState:
    """The process groups of one rank and the collectives models use.

    Build it with ``ParallelState.single()`` for one device, or ``init_parallel_state`` in each
    worker of a split model (after its device is bound).
    """

    def __init__(
        self,
        ranks: ParallelRanks,
        tp_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.ranks = ranks
        self.tp_group = tp_group
        self.pp_group = pp_group

    @classmethod
    def single(cls) -> ParallelState:
        """One rank: every collective is the identity."""
        return cls(ParallelRanks(rank=0))

    @property
    def tp_size(self) -> int:
        return self.ranks.tp_size

    @property
    def tp_rank(self) -> int:
        return self.ranks.tp_rank

    # ---- tensor parallelism -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the tensor-parallel group (in place; returned for chaining)."""
        if self.tp_group is not None:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's ``tensor`` along ``dim``, in rank order."""
        if self.tp_group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    # ---- pipeline parallelism -----------------------------------------------------------------

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Send ``tensors`` to the same TP rank of the next stage (blocking)."""
        target = self.ranks.rank + self.tp_size
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=target, group=self.pp_group)

    def receive_from_previous_stage(self, tensors: list[torch.Tensor]) -> None:
        """Fill ``tensors`` (allocated with the right shapes) from the previous stage."""
        source = self.ranks.rank - self.tp_size
        for tensor in tensors:
            dist.recv(tensor, src=source, group=self.pp_group)

    def broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every stage gets the last stage's ``tensor`` (same shape and dtype everywhere)."""
        if self.pp_group is None:
            return tensor
        source = self.ranks.output_rank + self.tp_rank
        dist.broadcast(tensor, src=source, group=self.pp_group)
        return tensor


def init_parallel_state(
    ranks: ParallelRanks, backend: str, init_method: str, device: torch.device
) -> ParallelState:
    """Join the world of ``ranks.world_size`` processes and make this rank's groups.

    :param backend: the ``torch.distributed`` backend (``Backend.dist_backend``: "nccl" for
        CUDA and ROCm, "gloo" for the CPU).
    :param init_method: the rendezvous (``tcp://host:port``), the same for every rank.
    :param device: this rank's device (NCCL binds its communicator to it).
    """
    if ranks.world_size == 1:
        return ParallelState(ranks)
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=ranks.rank,
        world_size=ranks.world_size, timeout=COLLECTIVE_TIMEOUT, **kwargs,
    )
    # Every rank must create every group, in the same order (torch.distributed's rule).
    tp_group = pp_group = None
    for stage in range(ranks.pp_size):
        members = [stage * ranks.tp_size + i for i in range(ranks.tp_size)]
        group = dist.new_group(members) if ranks.tp_size > 1 else None
        if ranks.rank in members:
            tp_group = group
    for tp_rank in range(ranks.tp_size):
        members = [stage * ranks.tp_size + tp_rank for stage in range(ranks.pp_size)]
        group = dist.new_group(members) if ranks.pp_size > 1 else None
        if ranks.rank in members:
            pp_group = group
    logger.info("rank %d of %d joined (%s): tensor-parallel rank %d of %d, stage %d of %d",
                ranks.rank, ranks.world_size, backend, ranks.tp_rank, ranks.tp_size,
                ranks.pp_rank, ranks.pp_size)
    return ParallelState(ranks, tp_group, pp_group)


def destroy_parallel_state() -> None:
    """Leave the world (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when exact, else a ``ValueError`` saying what to change."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator
