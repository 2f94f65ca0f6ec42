"""The ROCm worker: the core's worker on one AMD GPU.

PyTorch addresses HIP devices as ``torch.device("cuda", i)`` and ``torch.cuda.set_device``;
``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``, which ROCm honours too) picks which
physical GPUs a process sees. Tensor parallelism, once the core has it, will build its
process group with the backend's ``dist_backend="nccl"``, which ROCm builds of torch
implement with RCCL.

Decode steps run eagerly (no HIP graph capture): see ``BackendCapabilities.cuda_graphs`` in
``octavo_rocm.plugin`` and docs/rocm.md.
"""

from __future__ import annotations

import logging

import torch
from octavo.worker.worker import Worker

logger = logging.getLogger(__name__)


class ROCmWorker(Worker):
    def init_device(self) -> None:
        index = 0  # one GPU per worker; tensor parallelism will pass the local rank
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "unknown arch")
        logger.debug(
            "ROCm worker on %s (%s, %s, HIP %s)",
            self.device, torch.cuda.get_device_name(index), arch, torch.version.hip,
        )
        logger.info("backend rocm: decode steps run eagerly (HIP graphs are not enabled yet)")
