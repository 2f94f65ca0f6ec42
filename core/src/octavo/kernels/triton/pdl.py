"""Programmatic dependent launch (PDL) for the small Triton kernels of a decode step.

At batch 1 a decode step is a chain of ~300 kernels of a few microseconds each, every one
waiting for the one before to finish before its programs are even placed on the SMs. With
PDL (NVIDIA compute capability 9.0 and later: Hopper, Blackwell) a kernel may be launched
while the kernel before it on the stream still runs, once every program of that one has
signalled (``gdc_launch_dependents``); it then waits (``gdc_wait``) until the kernel before
has finished and its writes are visible. The launch and placement of each kernel overlap the
end of the one before. CUDA graphs record such launches as programmatic edges, so replayed
decode steps keep the overlap.

Launched so: the RMS norms, rotary (and its variant that rotates the keys into the cache),
the KV-cache write, the decode attention's partition and reduce kernels, SiLU-and-mul, the
greedy argmax's two kernels (``tests/kernels/sm90_decode_compile_check.py`` compiles each
for sm_90), and the one-row
dense GEMV (``octavo.kernels.triton.dense_gemv``), which loads its first weight tile before
its wait (weights are never written in a step); ``fp8_gemv`` and ``int4_gemv`` at one row
load their first step's weights so too, where ``OCTAVO_SKINNY_PDL`` is on
(``skinny_pdl_launch``). Waiting first, as the other kernels do, those two had made the
Llama-3-8B int4 step slower, not faster (docs/benchmarks.md). ``gguf_gemv`` is not
launched so.

Contract for a kernel launched with ``**pdl_launch(device)``: it takes ``USE_PDL:
tl.constexpr`` and calls ``pdl_begin(USE_PDL)`` before it loads anything a kernel may have
written in this step and before it stores anything or touches the split-K workspace (the
norms, rotary, cache write, attention, SiLU and argmax: as their first statement; the GEMVs: after
their first weight loads, and weights alone). A kernel that never waits would let the kernel
after it overtake the one before it. Kernels launched
without the option (torch's, cuBLAS's) keep plain stream order on both sides.

Off (``{"USE_PDL": False}``, no launch attribute): under the interpreter, on other GPUs
(compute capability below 9.0, ROCm), on the CPU, and with ``OCTAVO_PDL=0`` (every kernel
above; A/B runs; read once per process).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from octavo import envs


@triton.jit
def pdl_begin(USE_PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (a no-op when off)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def _launch_for(device_index: int) -> dict[str, bool]:
    """The launch arguments for a CUDA device (read once per process: launches are on the
    host's hot path)."""
    # Imported here: cache_write's own kernel takes pdl_begin from this module.
    from octavo.kernels.triton.cache_write import interpreting

    if interpreting() or not envs.pdl() or torch.version.hip is not None \
            or torch.cuda.get_device_capability(device_index)[0] < 9:
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


_OFF = {"USE_PDL": False}


@functools.cache
def _skinny_on() -> bool:
    return envs.skinny_pdl()


def skinny_pdl_launch(device: torch.device, rows: int) -> dict[str, bool]:
    """``pdl_launch`` for a launch of ``fp8_gemv`` / ``int4_gemv`` over ``rows`` rows: on for
    one row where PDL is on and ``OCTAVO_SKINNY_PDL`` is (read once per process)."""
    if rows != 1 or not _skinny_on():
        return _OFF
    return pdl_launch(device)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel launch on ``device``: ``USE_PDL`` for the kernel, and
    Triton's ``launch_pdl`` launch option where PDL is on (module docstring)."""
    if device.type != "cuda":
        return _OFF
    return _launch_for(device.index if device.index is not None else torch.cuda.current_device())
