"""How much memory a torch device has, for the memory-profiling sanity checks."""

from __future__ import annotations

import os

import torch


def total_device_memory(device: torch.device) -> int:
    """Bytes of memory of ``device``: physical host memory for ``cpu``, else the total that
    ``torch.<device type>.mem_get_info`` reports (CUDA, ROCm, and out-of-tree devices that
    provide it).

    Raises ``NotImplementedError`` naming the device type when neither applies.
    """
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module = getattr(torch, device.type, None)
    mem_get_info = getattr(module, "mem_get_info", None)
    if mem_get_info is None:
        raise NotImplementedError(
            f"cannot tell how much memory a {device.type!r} device has: torch.{device.type} "
            "has no mem_get_info(device) returning (free, total) bytes"
        )
    return int(mem_get_info(device)[1])
