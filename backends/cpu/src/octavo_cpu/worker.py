"""The CPU worker: the core's worker on the host, with its threads planned and pinned
(``octavo_cpu.threads``). GGUF weights kept in their blocks run on the backend's C++ kernels
through the ``gguf`` quantization method (``octavo_cpu.quant.quant_kernels``); the layers'
small ops (RMSNorm, rotary, SiLU-and-mul) on its C++ ops (``octavo_cpu.layers``); decoder
layers it covers whole as one C++ call each (``octavo_cpu.fused_layer``)."""

from __future__ import annotations

import logging

import torch
from octavo.worker.worker import Worker

from octavo_cpu.fused_layer import install_fused_decoder_layers
from octavo_cpu.layers import register_layer_kernels
from octavo_cpu.threads import configure_threads

logger = logging.getLogger(__name__)


class CPUWorker(Worker):
    def init_device(self) -> None:
        self.device = torch.device("cpu")
        configure_threads(self.config.parallel_config.cpu_threads, self.ranks.world_size,
                          self.local_rank)
        register_layer_kernels()

    def load_model(self) -> None:
        super().load_model()
        if self.config.lora_config is not None:
            # LoRA adds its products in the Python linear layers, which one C++ call per
            # layer would skip.
            logger.info("cpu backend: LoRA is enabled; decoder layers run their Python forward")
            return
        install_fused_decoder_layers(self.model)
