"""What a pipeline stage receives from the one before it and sends to the one after.

Every stage runs the same step (the same ``SchedulerOutput``, so the same flat batch of
``num_tokens`` tokens); between stages travel the two halves of the residual stream,
``[num_tokens, hidden_size]`` each, in the model's dtype. The shapes are known on both sides,
so only the tensors are sent. Stages run steps in the order they are given, so step N's hidden
states reach the next stage before step N+1's.
"""

from __future__ import annotations

import torch

from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.models.interfaces import IntermediateTensors


class StageIO:
    """The point-to-point transfers of one rank of a pipeline-parallel model."""

    def __init__(self, parallel: ParallelState, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.parallel = parallel
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    @property
    def is_first(self) -> bool:
        return self.parallel.ranks.is_first_stage

    @property
    def is_last(self) -> bool:
        return self.parallel.ranks.is_last_stage

    def receive(self, num_tokens: int) -> IntermediateTensors | None:
        """The previous stage's output for a step of ``num_tokens`` (None on the first)."""
        if self.is_first:
            return None
        tensors = [torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                   for _ in range(2)]
        self.parallel.receive_from_previous_stage(tensors)
        return IntermediateTensors(hidden_states=tensors[0], residual=tensors[1])

    def send(self, intermediate: IntermediateTensors) -> None:
        """Hand this stage's output to the next stage."""
        self.parallel.send_to_next_stage([intermediate.hidden_states, intermediate.residual])
