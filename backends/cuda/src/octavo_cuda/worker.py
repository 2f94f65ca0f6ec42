"""The CUDA worker: the core's worker on one NVIDIA GPU."""

from __future__ import annotations

import logging

import torch

from octavo.worker.worker import Worker

logger = logging.getLogger(__name__)


class CUDAWorker(Worker):
    def init_device(self) -> None:
        index = 0  # one GPU per worker; tensor parallelism will pass the local rank
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        logger.debug("CUDA worker on %s (%s)", self.device, torch.cuda.get_device_name(index))

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture decode CUDA graphs unless enforce_eager."""
        super().initialize_cache(num_blocks)
        if self.config.model_config.enforce_eager:
            logger.info("enforce_eager: CUDA graphs are off")
            return
        from octavo_cuda.cuda_graph import DecodeGraphRunner

        runner = self.model_runner
        graphs = DecodeGraphRunner(
            model=runner.model,
            kv_caches=runner.kv_caches,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            max_model_len=self.config.model_config.max_model_len,
            block_size=self.config.cache_config.block_size,
            device=self.device,
        )
        graphs.capture()
        runner.graph_runner = graphs
