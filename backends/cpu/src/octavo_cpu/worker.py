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
from octavo_cpu.threads import configure_threads, step_pinning

logger = logging.getLogger(__name__)


class CPUWorker(Worker):
    _step_cpu: int | None = None  # set by init_device (octavo_cpu.threads.ThreadPlan)

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        plan = configure_threads(self.config.parallel_config.cpu_threads, self.ranks.world_size,
                                 self.local_rank)
        self._step_cpu = plan.step_cpu
        register_layer_kernels()

    def load_model(self) -> None:
        super().load_model()
        if self.config.lora_config is not None:
            # LoRA adds its products in the Python linear layers, which one C++ call per
            # layer would skip.
            logger.info("cpu backend: LoRA is enabled; decoder layers run their Python forward")
            return
        install_fused_decoder_layers(self.model)

    # The step's compute runs with the calling thread on its own core (octavo_cpu.threads).
    def execute_model(self, scheduler_output):
        with step_pinning(self._step_cpu):
            return super().execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output):
        with step_pinning(self._step_cpu):
            return super().execute_model_async(scheduler_output)

    def sample_tokens(self, grammar_bitmask):
        with step_pinning(self._step_cpu):
            return super().sample_tokens(grammar_bitmask)
