"""The template's worker: the core's ``Worker`` on the template device.

The base class loads the model, sizes and allocates the KV cache (through the memory hook)
and runs steps; a backend picks and prepares its device, and may override
``initialize_cache`` to do more once the cache exists (the CUDA backend captures CUDA graphs
there).
"""

from __future__ import annotations

import logging

import torch
from octavo.worker.worker import Worker

logger = logging.getLogger(__name__)


class TemplateWorker(Worker):
    def init_device(self) -> None:
        # VENDOR: bind this worker to its device and prepare it (context, streams), e.g.
        #   torch.mydev.set_device(local_rank); self.device = torch.device("mydev", local_rank)
        # One worker per device; tensor parallelism will pass the local rank.
        self.device = torch.device("cpu")
        logger.debug("template worker on %s", self.device)
