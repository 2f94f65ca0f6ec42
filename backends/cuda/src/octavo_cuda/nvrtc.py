"""CUDA C++ kernels compiled at run time: NVRTC to a cubin for the device, the driver API to
load and launch it (with programmatic dependent launch where the GPU has it).

The backend ships kernel sources (``octavo_cuda/kernels/*.cu``), not binaries, so installing it
needs no CUDA toolkit: NVRTC is the library PyTorch's CUDA builds already depend on
(``libnvrtc``, from the ``nvidia-cuda-nvrtc`` wheel or the system), and the driver
(``libcuda``) is there wherever a GPU is. A kernel is compiled once per (source, macros,
device architecture) in a process.

Launches go to the current torch stream, so they are captured into CUDA graphs like any
other kernel. With ``pdl=True`` (compute capability 9.0 and up) a launch may begin while the
kernel before it is finishing; the kernel must then execute ``griddepcontrol.wait`` before it
reads anything that kernel writes (``octavo.kernels.triton.pdl`` launches the Triton kernels
of a decode step so).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# CUlaunchAttributeID: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class NvrtcError(RuntimeError):
    """A kernel source that NVRTC could not compile, or a library that could not be found."""


class _LaunchAttributeValue(ctypes.Union):
    # CUlaunchAttributeValue: 64 bytes, 8-byte aligned (some members hold pointers)
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int), ("align", ctypes.c_void_p)]


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: a 4-byte id, 4 bytes of padding, the value
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4),
                ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint32), ("grid_y", ctypes.c_uint32),
                ("grid_z", ctypes.c_uint32), ("block_x", ctypes.c_uint32),
                ("block_y", ctypes.c_uint32), ("block_z", ctypes.c_uint32),
                ("shared_bytes", ctypes.c_uint32), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


def _nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be: the nvidia-cuda-nvrtc wheel PyTorch depends on (any CUDA major
    version), then the loader's search path."""
    found = []
    for entry in sys.path:
        for pattern in ("nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*"):
            found += sorted(p for p in glob.glob(os.path.join(entry, pattern))
                            if "builtins" not in p and ".alt." not in p)
    return list(dict.fromkeys(found)) + ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    errors = []
    for candidate in _nvrtc_candidates():
        try:
            return ctypes.CDLL(candidate)
        except OSError as exc:
            errors.append(f"{candidate}: {exc}")
    raise NvrtcError("libnvrtc (CUDA's runtime compiler) was not found; install the "
                     "nvidia-cuda-nvrtc wheel matching torch's CUDA version. Tried: "
                     + "; ".join(errors[-3:]))


def require_nvrtc() -> None:
    """``NvrtcError`` (saying what to install) when libnvrtc cannot be loaded here."""
    _nvrtc()


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise NvrtcError(f"the CUDA driver (libcuda.so.1) could not be loaded: {exc}") from None


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA error {result} ({text})")


def compile_cubin(source: str, name: str, arch: int, defines: dict[str, int]) -> bytes:
    """``source`` compiled by NVRTC for ``sm_<arch>`` (e.g. 90) with ``-D`` ``defines``: the
    cubin. ``NvrtcError`` with NVRTC's log when it does not compile."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    result = lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(),
                                    f"{name}.cu".encode(), 0, None, None)
    if result != 0:
        raise NvrtcError(f"nvrtcCreateProgram failed for {name} (NVRTC error {result})")
    try:
        options = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "-default-device",
                   *(f"-D{key}={value}" for key, value in sorted(defines.items()))]
        array = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = lib.nvrtcCompileProgram(program, len(options), array)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise NvrtcError(f"NVRTC could not compile {name} ({' '.join(options)}):\n"
                             f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel function loaded on one device (a ``CUfunction``; the module stays loaded for
    the process)."""

    function: int
    device: int
    name: str

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[object],
               shared_bytes: int = 0, pdl: bool = False, stream: int | None = None) -> None:
        """Launch on ``stream`` (a ``CUstream`` handle; default: torch's current stream on the
        kernel's device). ``args``: tensors (their data pointers), Python ints (C ``int``) and
        floats (C ``float``), in the kernel's parameter order."""
        values: list[ctypes._SimpleCData] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                values.append(ctypes.c_void_p(arg.data_ptr()))
            elif isinstance(arg, bool) or not isinstance(arg, (int, float)):
                raise TypeError(f"{self.name}: unsupported kernel argument {type(arg).__name__}")
            elif isinstance(arg, int):
                values.append(ctypes.c_int(arg))
            else:
                values.append(ctypes.c_float(arg))
        params = (ctypes.c_void_p * len(values))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        attribute = _LaunchAttribute()
        attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.flag = 1  # programmaticStreamSerializationAllowed
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        config = _LaunchConfig(*grid, *block, shared_bytes, ctypes.c_void_p(stream),
                               ctypes.pointer(attribute) if pdl else None, 1 if pdl else 0)
        _check_driver(_driver().cuLaunchKernelEx(ctypes.byref(config),
                                                 ctypes.c_void_p(self.function), params, None),
                      f"launching {self.name}")


_LOADED: dict[tuple, CompiledKernel] = {}


def load_kernel(source: str, name: str, defines: dict[str, int],
                device: torch.device) -> CompiledKernel:
    """``name`` from ``source`` with ``defines``, compiled for ``device``'s architecture and
    loaded on it (cached per process)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (source, name, tuple(sorted(defines.items())), index)
    kernel = _LOADED.get(key)
    if kernel is None:
        major, minor = torch.cuda.get_device_capability(index)
        cubin = compile_cubin(source, name, 10 * major + minor, defines)
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)  # the device's primary context is current
            module = ctypes.c_void_p()
            _check_driver(_driver().cuModuleLoadData(ctypes.byref(module), cubin),
                          f"loading {name}")
            function = ctypes.c_void_p()
            _check_driver(_driver().cuModuleGetFunction(ctypes.byref(function), module,
                                                        name.encode()), f"finding {name}")
        kernel = _LOADED[key] = CompiledKernel(function.value, index, name)
    return kernel
