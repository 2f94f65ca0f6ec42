"""The CPU worker: the core's worker on the host, with torch using every allowed core."""

from __future__ import annotations

import logging
import os

import torch
from octavo.worker.worker import Worker

logger = logging.getLogger(__name__)


class CPUWorker(Worker):
    def init_device(self) -> None:
        self.device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if "OMP_NUM_THREADS" not in os.environ and cores:
            # The ranks of a split model share the host's cores instead of each taking all.
            torch.set_num_threads(max(1, cores // self.ranks.world_size))
        logger.debug("CPU worker: %d torch threads", torch.get_num_threads())
