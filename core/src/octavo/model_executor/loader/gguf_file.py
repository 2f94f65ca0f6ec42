"""One parse of a GGUF file per process, shared by the config, the tokenizer and the weights.

``read_gguf(path)`` maps the file and parses its header (every metadata key, the tensor
table) once; later calls for the same file (same resolved path, size and modification time)
return the same ``GGUFFile``. Tensor data is never copied here: ``tensor_data`` is a
read-only view of the memory map, read from disk only when touched.

Why not ``gguf.GGUFReader``: it builds a numpy view per metadata item, about a million of them
for a 49k-token vocabulary and its merges, which takes seconds; this reader walks the header
with ``struct`` (a tenth of a second) and only knows what Octavo needs.

The format (little-endian GGUF v2/v3): magic ``GGUF``, version (u32), tensor count (u64),
metadata count (u64); each metadata item is a key (string), a value type (u32) and the value;
then per tensor its name, number of dims (u32), dims (u64 each, innermost first), ggml type
(u32) and offset (u64) into the data section, which starts at the next multiple of
``general.alignment`` (default 32) after the tensor table.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import gguf
import numpy as np

logger = logging.getLogger(__name__)

_VERSIONS = (2, 3)
# Fixed-size value types: GGUF type id -> struct format (little-endian).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """Where one tensor's bytes are and how they are stored."""

    # llama.cpp name (``blk.0.attn_q.weight``).
    name: str
    # Dimensions innermost first, as GGUF stores them (reverse for torch/HF order).
    shape: tuple[int, ...]
    # Storage type (F32, F16, Q4_1, ...).
    qtype: gguf.GGMLQuantizationType
    # Byte offset of the data from the start of the file.
    offset: int
    # Bytes the data takes.
    num_bytes: int


@dataclass(slots=True)
class GGUFFile:
    """A parsed GGUF file: its metadata, its tensor table and a memory map of its data."""

    # The file (resolved).
    path: Path
    # Every metadata key -> value (ints, floats, bools, strings; arrays as lists).
    metadata: dict[str, Any]
    # Tensors in file order.
    tensors: list[GGUFTensorInfo]
    # Read-only map of the whole file (tensor data is read through it lazily).
    _map: mmap.mmap = field(repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored data, flat and read-only: float32/float16 values for F32/F16,
        raw bytes (uint8) for quantized types (what ``gguf_loader.dequantize`` takes)."""
        dtype = {gguf.GGMLQuantizationType.F32: np.float32,
                 gguf.GGMLQuantizationType.F16: np.float16}.get(info.qtype, np.uint8)
        count = info.num_bytes // np.dtype(dtype).itemsize
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset)


_cache: dict[tuple[str, int, int], GGUFFile] = {}
_lock = threading.Lock()


def read_gguf(path: str | Path) -> GGUFFile:
    """The parsed GGUF file at ``path``, parsed at most once per process while it is unchanged.

    ``FileNotFoundError`` for a missing file, ``ValueError`` for a file that is not GGUF v2/v3.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist or is not a file")
    resolved = path.resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _lock:
        cached = _cache.get(key)
        if cached is None:
            # A rewritten file gets a new key; drop the old parse of the same path.
            for old in [k for k in _cache if k[0] == key[0]]:
                del _cache[old]
            cached = _cache[key] = _parse(resolved)
            logger.debug("parsed %s: %d metadata keys, %d tensors", resolved,
                         len(cached.metadata), len(cached.tensors))
    return cached


def clear_gguf_cache() -> None:
    """Forget every parsed file (tests; the maps close when no tensor view uses them)."""
    with _lock:
        _cache.clear()


class _Cursor:
    """Reads GGUF values from a buffer, advancing a position."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buffer, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buffer[start:self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                values = struct.unpack_from(f"<{count}{fmt[1]}", self.buffer, self.pos)
                self.pos += count * struct.calcsize(fmt)
                return list(values)
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"GGUF file {str(self.path)!r} has a metadata value of unknown type "
                         f"{value_type} at byte {self.pos}; the file is damaged or not GGUF")


def _parse(path: Path) -> GGUFFile:
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size < 24:
            raise ValueError(f"{str(path)!r} is too short to be a GGUF file")
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer, path)
    try:
        magic, version = cursor.unpack("<4sI")
        if magic != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with 'GGUF')")
        if version not in _VERSIONS:
            raise ValueError(f"{str(path)!r} is GGUF version {version}; Octavo reads "
                             "little-endian GGUF v2 and v3")
        num_tensors, num_metadata = cursor.unpack("<QQ")
        metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = cursor.string()
            (value_type,) = cursor.unpack("<I")
            metadata[key] = cursor.value(value_type)
        entries = []
        for _ in range(num_tensors):
            name = cursor.string()
            (num_dims,) = cursor.unpack("<I")
            shape = cursor.unpack(f"<{num_dims}Q")
            qtype, offset = cursor.unpack("<IQ")
            entries.append((name, tuple(int(d) for d in shape), qtype, offset))
    except struct.error as exc:
        raise ValueError(f"GGUF file {str(path)!r} is truncated or damaged ({exc})") from None
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, shape, qtype_id, offset in entries:
        qtype = gguf.GGMLQuantizationType(qtype_id)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        num_bytes = prod(shape) // block_size * type_size
        start = data_start + offset
        if start + num_bytes > len(buffer):
            raise ValueError(f"GGUF file {str(path)!r} is truncated: tensor {name!r} ends at byte "
                             f"{start + num_bytes}, the file has {len(buffer)}")
        tensors.append(GGUFTensorInfo(name, shape, qtype, start, num_bytes))
    return GGUFFile(path, metadata, tensors, buffer)
