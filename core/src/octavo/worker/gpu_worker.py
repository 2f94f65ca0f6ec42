"""``GPUWorker``: the core's worker on one GPU that torch addresses as ``cuda``.

Serves the CUDA and ROCm backends alike: ROCm builds of torch keep the CUDA names (device type
``"cuda"``, ``torch.cuda.set_device``; ``HIP_VISIBLE_DEVICES`` or ``CUDA_VISIBLE_DEVICES``
pick the physical GPUs), and ``torch.cuda.CUDAGraph`` records HIP graphs there. Decode steps
are captured as graphs (``octavo.worker.cuda_graph``) when the backend declares
``BackendCapabilities.cuda_graphs`` and ``enforce_eager`` is off; with speculative decoding,
steps that verify drafts too when it declares ``cuda_graphs_multi_token``; with LoRA, steps
with adapters have graphs of their own.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from octavo.lora.layers import LoRAGraphInputs
from octavo.worker.graph_runner import GraphRunner
from octavo.worker.worker import Worker

logger = logging.getLogger(__name__)


class GPUWorker(Worker):
    """One GPU per worker: device ``local_rank`` of those the process sees."""

    def init_device(self) -> None:
        index = self.local_rank
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank {self.ranks.rank} needs GPU {index}, but this process sees "
                f"{torch.cuda.device_count()}: lower --tensor-parallel-size x "
                "--pipeline-parallel-size, or make more GPUs visible")
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        _one_cpu_thread_for_torch()
        properties = torch.cuda.get_device_properties(index)
        arch = getattr(properties, "gcnArchName", None)  # AMD GPUs only
        logger.debug(
            "backend %s: worker on %s (%s%s)", self.config.backend, self.device,
            properties.name, f", {arch}, HIP {torch.version.hip}" if arch else "",
        )

    def make_graph_runner(self) -> GraphRunner | None:
        """CUDA (or HIP) graphs of decode steps (and verification steps when speculating),
        captured now, unless turned off."""
        if self.ranks.pp_size > 1:
            logger.info("pipeline parallelism: decode steps run eagerly (no graph capture)")
            return None
        if not self.config.backend_capabilities.cuda_graphs:
            logger.info("backend %s: decode steps run eagerly (no graph capture declared)",
                        self.config.backend)
            return None
        if self.config.model_config.enforce_eager:
            logger.info("enforce_eager: CUDA graphs are off")
            return None
        from octavo.worker.cuda_graph import CudaGraphRunner, capture_sizes

        assert self.model_runner is not None, "load_model() must run first"
        runner = self.model_runner
        query_len = self._verification_query_len()
        shape_limits = functools.partial(
            CudaGraphRunner,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            max_model_len=self.config.model_config.max_model_len,
            block_size=self.config.cache_config.block_size,
            device=self.device,
        )
        graphs = shape_limits(runner.model, runner.kv_caches, max_query_len=query_len,
                              lora=self._lora_graph_inputs(query_len))
        graphs.capture()
        drafter = runner.drafter
        if drafter is not None:
            # The draft model's (or EAGLE head's) steps: one-token proposal steps, and (with
            # multi-token graphs) its first forward after a verifying step (the verified token,
            # up to K accepted drafts and the newest token: K + 2 tokens a sequence).
            draft_query_len = 1 if query_len == 1 else query_len + 1
            max_tokens = capture_sizes(self.config.scheduler_config.max_num_seqs)[-1] * (
                draft_query_len)
            drafter.graph_runner = shape_limits(
                drafter.graph_model(max_tokens), drafter.kv_caches,
                max_query_len=draft_query_len)
            drafter.graph_runner.capture()
        return graphs

    def row_ladder_sizes(self) -> list[int]:
        """The decode graphs' batch-size ladder (1, 2, 4, 8, multiples of 16 up to
        ``max_num_seqs``): GEMM libraries pick a kernel per new shape at a host cost of
        0.2-6 ms, and the LM head's rows (rows sampled) and an eager step's tokens take a new
        count nearly every step."""
        from octavo.worker.cuda_graph import capture_sizes

        return capture_sizes(self.config.scheduler_config.max_num_seqs)

    def _verification_query_len(self) -> int:
        """Tokens per sequence of a step that verifies drafts, when such steps are captured
        (1: decode steps only)."""
        spec = self.config.speculative_config
        if spec is None:
            return 1
        if not self.config.backend_capabilities.cuda_graphs_multi_token:
            logger.info("backend %s: steps that verify drafts run eagerly (no multi-token "
                        "graph capture declared)", self.config.backend)
            return 1
        return 1 + spec.num_speculative_tokens

    def _lora_graph_inputs(self, query_len: int) -> LoRAGraphInputs | None:
        """The buffers LoRA steps' graphs read their adapter rows from (None: no LoRA)."""
        manager = self.model_runner.lora_manager if self.model_runner is not None else None
        if manager is None or manager.batch.kernel is None:
            return None
        max_tokens = self.config.scheduler_config.max_num_seqs * query_len
        return LoRAGraphInputs(manager.batch, manager.config.max_loras, max_tokens, self.device)


def _one_cpu_thread_for_torch() -> None:
    """Run torch's host-side ops on one thread unless ``OMP_NUM_THREADS`` says otherwise.

    A GPU worker's host tensors are small (batch inputs, sampled tokens); torch's OpenMP pool
    gains nothing on them, and its threads spin after every parallel region on the cores
    that the scheduler, the output path and the grammar threads need: filling 256 grammar
    masks took 2.2-6.0 ms beside torch's pool against 0.9-1.0 ms alone on a 16-core H100 host
    (docs/benchmarks.md). vLLM's workers do the same.
    """
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or threads == 1:
        return
    torch.set_num_threads(1)
    logger.info("GPU worker: torch's host ops run on one thread (was %d) so that its idle "
                "threads do not spin on the engine's cores; set OMP_NUM_THREADS to choose",
                threads)
