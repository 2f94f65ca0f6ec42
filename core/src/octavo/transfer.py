"""Host <-> device copies that never make the host wait for queued device work.

A plain copy from pageable host memory to a GPU (``torch.tensor(..., device="cuda")``,
``tensor.to("cuda")``), or a ``.tolist()`` of a GPU tensor, makes the host wait for every kernel
already queued on the stream. An engine that launches step N+1 before step N has finished
(async scheduling) must avoid both on its per-step path: these helpers go through pinned
memory and events instead. On non-CUDA devices (the CPU, third-party ones) they fall back to
plain, synchronous copies: correct, only without the overlap. HIP builds of torch report
their GPUs as ``cuda`` and take the same path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable: page-locked for every CUDA context of the process.
_HOST_REGISTER_PORTABLE = 1


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host on a GPU.

    The copy goes through pinned memory (torch's caching host allocator keeps the buffer
    alive until the copy has run). On the CPU this is the tensor itself.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class DeviceToHostCopy:
    """Copies device tensors to the host without blocking the host (on CUDA and HIP).

    Other devices copy synchronously here: correct, only without the overlap.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = []
            for tensor in tensors:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                self._host.append(host)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = [tensor.cpu() for tensor in tensors]

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, in the order given, once the copies are done."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def register_host_memory(array: np.ndarray) -> bool:
    """Page-lock ``array``'s memory for the GPUs (``cudaHostRegister``; HIP builds of torch
    call ``hipHostRegister``), so that copies from it to a device are asynchronous DMA without
    staging; for memory torch did not allocate (a mapping of shared memory). False, with a
    log line, where there is no CUDA or the driver refuses (the memory is then used as it
    was). The caller unregisters it (``unregister_host_memory``) before it is unmapped."""
    if not torch.cuda.is_available() or array.nbytes == 0:
        return False
    code = int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes,
                                                     _HOST_REGISTER_PORTABLE))
    if code != 0:
        logger.info("could not page-lock %d bytes of host memory for the GPU (CUDA error "
                    "%d); copies from it go through pinned staging buffers", array.nbytes,
                    code)
        return False
    return True


def unregister_host_memory(array: np.ndarray) -> None:
    """Undo ``register_host_memory(array)``; errors (a CUDA context already torn down at
    exit) are ignored: the pages are released with the process."""
    with contextlib.suppress(Exception):  # a context gone at interpreter exit
        torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
