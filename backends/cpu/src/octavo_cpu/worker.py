"""The CPU worker: the core's worker on the host, with its threads planned and pinned
(``octavo_cpu.threads``) and GGUF weights kept in their blocks (``octavo_cpu.quant``)."""

from __future__ import annotations

import logging

import torch
from octavo import envs
from octavo.model_executor.gguf_quantized import register_gguf_kernels
from octavo.worker.worker import Worker

from octavo_cpu.threads import configure_threads

logger = logging.getLogger(__name__)


class CPUWorker(Worker):
    def init_device(self) -> None:
        self.device = torch.device("cpu")
        configure_threads(self.config.parallel_config.cpu_threads, self.ranks.world_size,
                          self.local_rank)
        register_gguf_kernels("cpu", _gguf_kernels())


def _gguf_kernels():
    """The C++ GGUF matmuls, unless they cannot be had or ``OCTAVO_CPU_GGUF_KERNELS=0``."""
    if not envs.cpu_gguf_kernels():
        logger.info("GGUF weights: dequantized (OCTAVO_CPU_GGUF_KERNELS=0)")
        return None
    from octavo_cpu import quant

    return quant.gguf_kernels()
