"""CUDA graphs for decode steps: one captured forward per batch size of a ladder.

A ``GraphRunner`` (``octavo.worker.graph_runner``) that GPU workers make (``GPUWorker``):
``torch.cuda.CUDAGraph`` records CUDA graphs on NVIDIA builds of torch and HIP graphs on ROCm
builds, so one implementation serves both backends.

A decode step of a small model is launch-bound (hundreds of tiny kernels per step), so the
model forward of a pure-decode batch is captured once per batch size and replayed. Inputs
live in persistent buffers; a step of ``B`` sequences copies its inputs into the first ``B``
rows and replays the graph of the smallest captured size ``>= B``. Padding rows are inert:
slot ``-1`` (no cache write), query length 0 and sequence length 0 (the attention kernels
skip them); their outputs are discarded.

Graphs are captured with ``max_seq_len = max_model_len`` so the decode kernel's partition
grid covers any context; partitions past a sequence's length exit at once.
"""

from __future__ import annotations

import logging
import time

import torch

from octavo.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and it)."""
    sizes = {size for size in (1, 2, 4, 8) if size <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphRunner:
    """Captures and replays the model forward of pure-decode steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        # Persistent inputs; each graph reads the first rows of these.
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_bs, max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=batch_size,
            num_tokens=batch_size,
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            # Host copies are not used by graph-capturable kernels; kept for the contract.
            query_start_loc_cpu=list(range(batch_size + 1)),
            seq_lens_cpu=[1] * batch_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        for batch_size in reversed(self.sizes):
            # Inert dummy step: no cache writes; attention reads one slot of block 0.
            self.slot_mapping[:batch_size].fill_(-1)
            self.seq_lens[:batch_size].fill_(1)
            self.query_start_loc[: batch_size + 1].copy_(
                torch.arange(batch_size + 1, dtype=torch.int32)
            )
            metadata = self._metadata(batch_size)
            ids, positions = self.input_ids[:batch_size], self.positions[:batch_size]
            self.model(ids, positions, self.kv_caches, metadata)  # warm-up: compiles kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, self.kv_caches, metadata)
            if pool is None:
                pool = graph.pool()
            self.graphs[batch_size] = graph
            self.outputs[batch_size] = hidden
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s",
            self.sizes, time.perf_counter() - start,
        )

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (
            metadata.is_pure_decode
            and metadata.num_tokens == metadata.num_seqs
            and metadata.num_seqs <= self.max_batch_size
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_seqs, hidden_size]
        """Replay the graph for this step's batch; returns the real rows' hidden states."""
        batch = metadata.num_seqs
        size = next(s for s in self.sizes if s >= batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(metadata.seq_lens, non_blocking=True)
        self.query_start_loc[: batch + 1].copy_(metadata.query_start_loc, non_blocking=True)
        width = metadata.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(metadata.block_tables, non_blocking=True)
        if size > batch:
            self.slot_mapping[batch:size].fill_(-1)
            self.seq_lens[batch:size].zero_()
            self.query_start_loc[batch + 1 : size + 1].fill_(batch)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
