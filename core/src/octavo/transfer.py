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

from collections.abc import Sequence

import torch


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
