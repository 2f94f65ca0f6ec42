"""CUDA graphs for decode and verification steps: one captured forward per step shape.

A ``GraphRunner`` (``octavo.worker.graph_runner``) that GPU workers make (``GPUWorker``):
``torch.cuda.CUDAGraph`` records CUDA graphs on NVIDIA builds of torch and HIP graphs on ROCm
builds, so one implementation serves both backends.

A decode step of a small model is launch-bound (hundreds of tiny kernels per step), so the
model forward is captured once per step shape and replayed. A shape is a number of sequences
from a ladder (``capture_sizes``) and a query length: 1 for decode steps, and with speculative
decoding also ``1 + num_speculative_tokens`` for steps that verify drafts (each sequence adds
up to that many tokens; the attention takes its multi-token path). A step runs on the
smallest shape that holds it: at most that many sequences, none adding more tokens than the
shape's query length.

With LoRA, every shape is captured twice: without adapters, and with the LoRA kernels reading
a mapping from persistent buffers (``octavo.lora.layers.LoRAGraphInputs``) that each LoRA step
stages before its replay.

Inputs live in persistent buffers; a step copies its inputs into their first rows. Padding is
inert: padding tokens have slot ``-1`` (no cache write) and belong to no sequence; padding
sequences have query length 0 and sequence length 0 (the attention kernels skip them). Their
outputs are discarded. Graphs are captured with ``max_seq_len = max_model_len`` so the decode
kernel's partition grid covers any context; partitions past a sequence's length exit at once.
"""

from __future__ import annotations

import logging
import time

import torch

from octavo.attention.base import AttentionMetadata
from octavo.lora.layers import LoRAGraphInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and it)."""
    sizes = {size for size in (1, 2, 4, 8) if size <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class CudaGraphRunner:
    """Captures and replays the model forward of decode (and verification) steps.

    ``max_query_len`` > 1 adds a second family of graphs in which every sequence may add up
    to that many tokens (speculative decoding's verification steps; also any step whose
    sequences add that few tokens, e.g. a short prefill chunk among decodes). ``lora``: the
    model's LoRA layers, whose steps get graphs of their own.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        *,
        max_query_len: int = 1,
        lora: LoRAGraphInputs | None = None,
    ) -> None:
        if max_query_len < 1:
            raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
        self.model = model
        self.kv_caches = kv_caches
        self.lora = lora
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        # Query lengths with graphs, ascending: decode, then verification when asked for.
        self.query_lens = sorted({1, max_query_len})
        max_bs = self.sizes[-1]
        max_tokens = max_bs * self.query_lens[-1]
        max_blocks = -(-max_model_len // block_size)
        # Persistent inputs; each graph reads the first rows of these.
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_bs, max_blocks), dtype=torch.int32, device=device)
        # Keyed by (sequences, query length, with LoRA).
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, num_seqs: int, query_len: int) -> AttentionMetadata:
        num_tokens = num_seqs * query_len
        return AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
            max_query_len=query_len,
            max_seq_len=self.max_model_len,
            # Host copies are not used by graph-capturable kernels; kept for the contract.
            query_start_loc_cpu=list(range(0, num_tokens + 1, query_len)),
            seq_lens_cpu=[query_len] * num_seqs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape, largest first so smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        for query_len in reversed(self.query_lens):
            for num_seqs in reversed(self.sizes):
                for with_lora in (False, True) if self.lora is not None else (False,):
                    if with_lora:
                        assert self.lora is not None
                        with self.lora.capturing(num_seqs * query_len):
                            graph, hidden = self._capture_one(num_seqs, query_len, pool)
                    else:
                        graph, hidden = self._capture_one(num_seqs, query_len, pool)
                    if pool is None:
                        pool = graph.pool()
                    self.graphs[(num_seqs, query_len, with_lora)] = graph
                    self.outputs[(num_seqs, query_len, with_lora)] = hidden
        logger.info(
            "captured CUDA graphs for batch sizes %s%s%s in %.1f s", self.sizes,
            f" at query lengths {self.query_lens}" if len(self.query_lens) > 1 else "",
            ", with and without LoRA" if self.lora is not None else "",
            time.perf_counter() - start,
        )

    def _capture_one(
        self, num_seqs: int, query_len: int, pool: object
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Inert dummy step: no cache writes; attention reads the first slots of block 0.
        num_tokens = num_seqs * query_len
        self.slot_mapping[:num_tokens].fill_(-1)
        self.seq_lens[:num_seqs].fill_(query_len)
        self.query_start_loc[: num_seqs + 1].copy_(
            torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32)
        )
        metadata = self._metadata(num_seqs, query_len)
        ids, positions = self.input_ids[:num_tokens], self.positions[:num_tokens]
        self.model(ids, positions, self.kv_caches, metadata)  # warm-up: compiles kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(ids, positions, self.kv_caches, metadata)
        return graph, hidden

    def shape_for(self, metadata: AttentionMetadata) -> tuple[int, int, bool] | None:
        """The (sequences, query length, with LoRA) of the graph that runs this step (the
        LoRA layers' mapping says whether it has adapter rows); None: none can."""
        if metadata.num_seqs > self.max_batch_size or metadata.max_query_len < 1:
            return None
        query_len = next((q for q in self.query_lens if q >= metadata.max_query_len), None)
        if query_len is None:
            return None
        with_lora = self.lora is not None and self.lora.step_has_lora
        return next(s for s in self.sizes if s >= metadata.num_seqs), query_len, with_lora

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return self.shape_for(metadata) is not None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Replay the graph for this step's shape; returns the real tokens' hidden states."""
        shape = self.shape_for(metadata)
        assert shape is not None, "run() needs a step that can_run() accepts"
        size, query_len, with_lora = shape
        seqs, tokens = metadata.num_seqs, metadata.num_tokens
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:seqs].copy_(metadata.seq_lens, non_blocking=True)
        self.query_start_loc[: seqs + 1].copy_(metadata.query_start_loc, non_blocking=True)
        width = metadata.block_tables.shape[1]
        self.block_tables[:seqs, :width].copy_(metadata.block_tables, non_blocking=True)
        # Padding: rows a previous, larger step filled must not write the cache again.
        self.slot_mapping[tokens : size * query_len].fill_(-1)
        if size > seqs:
            self.seq_lens[seqs:size].zero_()
            self.query_start_loc[seqs + 1 : size + 1].fill_(tokens)
        if with_lora:
            assert self.lora is not None
            self.lora.stage()
        self.graphs[shape].replay()
        return self.outputs[shape][:tokens]
