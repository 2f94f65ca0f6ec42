"""Launch configs of the small-M quantized kernels (``fp8_gemv``, ``int4_gemv``) and their tuner.

Both kernels give each program ``block_n`` output features and a range of the inputs: the
grid is ``[cdiv(N, block_n), split_k]``. With ``split_k > 1`` the programs add float32 partial
sums into a zeroed buffer (``tl.atomic_add``) that is cast to the activations' dtype after;
with 1 they store the result directly. ``split_k = 0`` asks ``choose_split_k`` to split until
about two programs per SM stream the weight.

``SkinnyTuner`` picks a config per (kernel, N, K, row bucket, dtype, device) the first time a
shape is seen outside CUDA-graph capture: it times a few candidates (whole calls, the zeroing
and cast of split-K included, on a flushed L2 via ``triton.testing.do_bench``) and keeps the
fastest for the process. During capture, under the interpreter, or with tuning off it uses the
kernel's heuristic default and times nothing. The decode graph runner runs every batch size
once eagerly before capturing it (``octavo.worker.cuda_graph``), so the captured kernels use
tuned configs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton

from octavo.kernels.triton.cache_write import interpreting

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """One launch of a small-M kernel."""

    # Output features per program.
    block_n: int
    # Inputs per loop step (int4: a divisor of the group size, a multiple of 8).
    block_k: int
    # Programs sharing each block of outputs' input range (0: ``choose_split_k``).
    split_k: int = 0
    # Warps per program.
    num_warps: int = 4
    # Software pipelining depth of the K loop.
    num_stages: int = 2


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """Programs wanted in flight: two per SM on a GPU (264 on an H100), 8 elsewhere."""
    if device.type != "cuda" or interpreting():
        return 8
    return 2 * _num_sms(device.index or 0)


def choose_split_k(n: int, k: int, config: SkinnyConfig, device: torch.device) -> int:
    """Programs per block of outputs: ``config.split_k``, or doubling while the grid has fewer
    than ``target_programs`` and each program keeps at least two K steps."""
    if config.split_k:
        return config.split_k
    blocks = triton.cdiv(n, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    target = target_programs(device)
    split = 1
    while blocks * split * 2 <= target and steps // (split * 2) >= 2:
        split *= 2
    return split


def k_per_split(k: int, split_k: int, block_k: int) -> int:
    """Inputs each program of a split covers: a whole number of ``block_k`` steps."""
    return triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k


TuneKey = tuple


class SkinnyTuner:
    """Per-process choice of ``SkinnyConfig`` by timing (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        # Tuned configs by key (kernel-specific shape key).
        self.best: dict[TuneKey, SkinnyConfig] = {}
        # Whether ``choose`` times candidates at all (tests and benchmarks switch it off).
        self.enabled = True

    def choose(self, key: TuneKey, device: torch.device, default: SkinnyConfig,
               candidates: Sequence[SkinnyConfig],
               run: Callable[[SkinnyConfig], object]) -> SkinnyConfig:
        """The config for ``key``: tuned already, tuned now (timing ``run(config)`` for each
        candidate), or ``default`` when timing is not possible here."""
        found = self.best.get(key)
        if found is not None:
            return found
        if (not self.enabled or device.type != "cuda" or interpreting()
                or torch.cuda.is_current_stream_capturing()):
            return default
        from triton.testing import do_bench

        if not self.best:
            logger.info("%s: small-M kernel in use; timing launch configs once per shape",
                        self.name)
        timings = []
        for config in dict.fromkeys([default, *candidates]):  # unique, default first
            try:
                ms = do_bench(lambda c=config: run(c), warmup=3, rep=15, return_mode="median")
            except Exception as exc:  # noqa: BLE001  (a config this device cannot run)
                logger.debug("%s %s: %s failed: %s", self.name, key, config, exc)
                continue
            timings.append((ms, config))
        best = min(timings, key=lambda t: t[0])[1] if timings else default
        self.best[key] = best
        logger.debug("%s %s: %s (%.1f us)", self.name, key, best,
                     min(t[0] for t in timings) * 1e3 if timings else float("nan"))
        return best
