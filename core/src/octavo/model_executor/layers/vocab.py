"""The token embedding and the LM head, split over the tensor-parallel ranks by vocabulary.

The vocabulary is padded to a multiple of the number of ranks and cut into equal contiguous
ranges; rank ``r`` holds the rows of range ``r`` (padding rows are zero and never chosen).

- ``VocabParallelEmbedding``: each rank looks up the tokens of its range (zeros for the
  others), and one all-reduce sums the ranks' rows into the embeddings.
- ``ParallelLMHead``: each rank computes the logits of its range, and the ranks' logits are
  gathered once, in rank order, then the padding is cut. Tied to the embedding, it uses the
  embedding's weight (the same partition).

With one rank both are the plain ``F.embedding`` / ``F.linear`` over the whole vocabulary, unless
a quantization method keeps the table quantized (``quant_method``, an ``EmbeddingMethod`` set by
``octavo.model_executor.model_loader.build_model``; GGUF blocks, one rank only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from octavo.distributed.parallel_state import ParallelState
from octavo.model_executor.layers.weights import Loaded, copy_checked, narrow, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """``embed(ids)`` over this rank's vocabulary range, summed over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.rows_per_rank
        # Rows of real tokens this rank holds (the last rank's range may run past the end).
        self.num_real_rows = max(0, min(self.rows_per_rank, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size),
                                   requires_grad=False)
        set_weight_loader(self.weight, self._load)
        # An EmbeddingMethod holding the table quantized (it replaces ``weight``), or None.
        self.quant_method = None

    def linear(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, rows_per_rank]
        """This rank's logits (as an LM head, or a tied embedding)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, None)
        return F.linear(hidden_states, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(embedded)

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
        assert shard_name is None, "the embedding has no shards"
        with torch.no_grad():
            if self.num_real_rows < self.rows_per_rank:
                param.data[self.num_real_rows:].zero_()  # padding rows: never looked up
            if self.num_real_rows:
                copy_checked(param.data[: self.num_real_rows],
                             narrow(loaded, 0, self.vocab_start, self.num_real_rows),
                             f"vocabulary rows {self.vocab_start}..")

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, rows {self.vocab_start}.."
                f"{self.vocab_start + self.rows_per_rank}")


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary, each rank computing its range (float32 out)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise TypeError("ParallelLMHead computes logits: call compute_logits")


def compute_logits(hidden_states: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """``[n, hidden_size]`` -> float32 ``[n, vocab_size]`` through ``head.linear`` (an LM head
    or, tied, the embedding; a GGUF-block head too), in the model dtype, gathered over the
    ranks."""
    logits = head.linear(hidden_states)  # [n, rows_per_rank]
    if head.parallel.tp_size > 1:
        logits = head.parallel.all_gather(logits, dim=-1)[:, : head.vocab_size]
    return logits.float()
