"""The CPU backend's C++ kernels: built on first use, cached, loaded in ms.

One library holds the paged attention (``ops.cpp``, ``attention_<isa>.cpp``), the matmuls
on GGUF-quantized weights (``quant_ops.cpp``, ``quant_<isa>.cpp``; Python API in
``octavo_cpu.quant``) and the decoder's small per-layer ops (``layer_ops.cpp``: RMSNorm, rotary,
SiLU-and-mul; given to the layers by ``octavo_cpu.layers``) and a whole decoder layer as one
call (``decoder_layer.cpp``; installed by ``octavo_cpu.fused_layer``).

Where the sources are: ``octavo_cpu/csrc/`` inside this package, not the repository's top-level
``csrc/cpu`` (which only points here). As package data they travel with every install mode
with no build step of their own: an editable install (``pip install -e backends/cpu``) reads
them from the source tree, a wheel (``pip install backends/cpu``, or one built from an sdist)
carries them through ``[tool.setuptools.package-data]`` in ``pyproject.toml``.

How they are built: ``torch.utils.cpp_extension.load`` (ninja, the system's C++ compiler,
torch's headers; no second torch, nothing at install time) into
``$XDG_CACHE_HOME/octavo/cpu-kernels/<key>/`` (``~/.cache`` by default), where ``<key>`` hashes
the sources, the compiler flags, the torch version and the Python ABI: a changed source builds
into a new folder, and an unchanged one is loaded directly (no ninja, no compiler; ~10 ms). A
file lock serialises first builds started together (tensor-parallel workers, pytest workers).
The library holds one copy of the kernels per instruction set (AVX2; AVX-512; AVX-512 with
bf16 dot products) and picks the best the CPU has at run time, so a cache shared by different
machines stays valid.

Nothing is built when this module is imported: ``load_kernels()`` builds when the CPU backend's
attention is first made. If the kernels cannot be had (no compiler, a failed build, not an
x86-64 Linux machine, no AVX2), it logs why once and returns ``None``, and the backend keeps
its torch implementation.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from octavo.attention.base import AttentionMetadata

logger = logging.getLogger("octavo.cpu.kernels")  # under the octavo tree: shown by its handler

CSRC_DIR = Path(__file__).parent / "csrc"
# Compiled, in this order; the headers beside them are hashed into the cache key too.
SOURCES = ("ops.cpp", "attention_avx2.cpp", "attention_avx512.cpp", "attention_avx512bf16.cpp",
           "quant_ops.cpp", "quant_avx2.cpp", "quant_avx512vnni.cpp", "threads.cpp",
           "layer_ops.cpp", "silu_avx2.cpp", "decoder_layer.cpp")
# No -m flags: each attention_<isa>.cpp selects its instruction set with a pragma.
CFLAGS = ("-O3", "-DNDEBUG", "-fopenmp")
LDFLAGS = ("-fopenmp",)
LIBRARY_NAME = "octavo_cpu_kernels"
BUILT_MARKER = "BUILT"  # written once the library is complete
# The kernels' limits (csrc/common.h); anything else takes the torch implementation.
HEAD_DIM_MULTIPLE = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_loaded: dict[str, CPUKernels | None] = {}


@dataclass(frozen=True, slots=True)
class CPUKernels:
    """The loaded ops, and the instruction sets they run on this CPU."""

    # Every instruction set this CPU can run, best last, e.g. ("avx2",) or
    # ("avx2", "avx512", "avx512bf16"); tests run each one.
    isas: tuple[str, ...]
    # The shared library the ops came from.
    library: Path
    _write_kv_cache: Any = field(repr=False)
    _paged_attention: Any = field(repr=False)
    # Instruction sets of the GGUF matmuls on this CPU, best last: ("avx2",) or
    # ("avx2", "avx512vnni"); the ops themselves are wrapped by octavo_cpu.quant.
    quant_isas: tuple[str, ...] = ()
    gguf_matmul_op: Any = field(default=None, repr=False)
    gguf_dequantize_op: Any = field(default=None, repr=False)
    # bind_threads(cpus, include_caller) -> cpu per OpenMP thread (octavo_cpu.threads).
    bind_threads_op: Any = field(default=None, repr=False)
    # The decoder's small ops (csrc/layer_ops.cpp), given to the layers by octavo_cpu.layers.
    rms_norm_op: Any = field(default=None, repr=False)
    fused_add_rms_norm_op: Any = field(default=None, repr=False)
    rotary_neox_op: Any = field(default=None, repr=False)
    silu_and_mul_op: Any = field(default=None, repr=False)
    # A whole Llama-style decoder layer in one call (csrc/decoder_layer.cpp), installed on
    # eligible layers by octavo_cpu.fused_layer.
    llama_decoder_layer_op: Any = field(default=None, repr=False)

    @property
    def isa(self) -> str:
        """The best instruction set (bfloat16 only: avx512bf16 where present)."""
        return self.isas[-1]

    def isa_for(self, dtype: torch.dtype) -> str:
        """The instruction set the kernels use by default for ``dtype`` (as ops.cpp picks)."""
        if self.isa == "avx512bf16" and dtype != torch.bfloat16:
            return "avx512"
        return self.isa

    def covers(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """True when the kernels take this step (else the caller uses torch)."""
        return (
            query.dtype == kv_cache.dtype
            and query.dtype in DTYPES
            and query.device.type == "cpu"
            and query.shape[-1] % HEAD_DIM_MULTIPLE == 0
            and kv_cache.dim() == 5
            and kv_cache.is_contiguous()
        )

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = skip
    ) -> None:
        """Store each token's K/V at its slot (the reference's ``write_kv_reference``)."""
        key = _last_dim_contiguous(key.to(kv_cache.dtype))
        value = _last_dim_contiguous(value.to(kv_cache.dtype))
        self._write_kv_cache(key, value, kv_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        isa: str = "",
        part_size: int = 0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
        """Causal attention of every new token over its sequence's cache (its last
        ``sliding_window`` positions when set, scores soft-capped at ``logits_soft_cap``).

        ``isa`` forces an instruction set from ``isas`` ("" = the best); ``part_size`` splits
        every sequence's keys into parts of that many positions (0 = only when there are too
        few sequences x KV heads for the threads), to test the split path.
        """
        return self._paged_attention(
            _last_dim_contiguous(query), kv_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables, scale, isa, part_size, sliding_window or 0,
            float(logits_soft_cap or 0.0),
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def load_kernels() -> CPUKernels | None:
    """The kernels, built on first use; ``None`` (logged once) when they cannot be had."""
    with _lock:
        if "kernels" not in _loaded:
            _loaded["kernels"] = _load_or_fall_back()
        return _loaded["kernels"]


def reset_for_tests() -> None:
    """Forget the outcome of ``load_kernels`` (the loaded library itself stays loaded)."""
    with _lock:
        _loaded.clear()


def _load_or_fall_back() -> CPUKernels | None:
    reason = _unsupported_platform()
    if reason is not None:
        logger.info("cpu attention: no C++ kernels (%s); using the torch implementation", reason)
        return None
    try:
        kernels = _load_or_build()
    except Exception as exc:  # a missing compiler or ninja, a failed build, a bad library
        logger.warning(
            "cpu backend: the C++ kernels could not be built or loaded, so attention runs "
            "the slower torch implementation and GGUF weights are dequantized on load. Cause: "
            "%s. Install a C++ compiler (g++) to get them; they build on first use.",
            _summary(exc),
        )
        logger.debug("cpu attention: build failure in full", exc_info=True)
        return None
    if not kernels.isas:
        logger.info("cpu attention: this CPU has no AVX2; using the torch implementation")
        return None
    return kernels


def _unsupported_platform() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"they are built on Linux only, this is {sys.platform}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they need an x86-64 CPU, this is {platform.machine()}"
    return None


def _summary(exc: BaseException) -> str:
    """One line of an error: torch's build errors carry the whole ninja and compiler output,
    so keep their first line and the first lines that say what went wrong (not the long
    compiler command lines)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    telling = ("error", "not found", "no such file", "cannot", "permission denied")
    errors = [line for line in lines[1:]
              if len(line) < 300 and any(word in line.lower() for word in telling)]
    first = lines[0].split(": [")[0][:200]  # "Error building extension '...'", no ninja command
    text = " | ".join([first, *errors[:2]])
    return text if len(text) <= 500 else text[:500] + " ..."


def _load_or_build() -> CPUKernels:
    build_dir = cache_root() / build_key()
    library = build_dir / f"{LIBRARY_NAME}.so"
    if (build_dir / BUILT_MARKER).exists():
        torch.ops.load_library(str(library))
    else:
        _build(build_dir)
    ops = torch.ops.octavo_cpu
    return CPUKernels(
        isas=tuple(ops.supported_isas()),
        library=library,
        _write_kv_cache=ops.write_kv_cache.default,
        _paged_attention=ops.paged_attention.default,
        quant_isas=tuple(ops.quant_isas()),
        gguf_matmul_op=ops.gguf_matmul.default,
        gguf_dequantize_op=ops.gguf_dequantize.default,
        bind_threads_op=ops.bind_threads.default,
        rms_norm_op=ops.rms_norm.default,
        fused_add_rms_norm_op=ops.fused_add_rms_norm.default,
        rotary_neox_op=ops.rotary_neox.default,
        silu_and_mul_op=ops.silu_and_mul.default,
        llama_decoder_layer_op=ops.llama_decoder_layer.default,
    )


def cache_root() -> Path:
    """Where builds are kept: ``$XDG_CACHE_HOME/octavo/cpu-kernels``, else ``~/.cache/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "octavo" / "cpu-kernels"


def build_key(source_dir: Path = CSRC_DIR) -> str:
    """Folder name of a build: torch version, Python ABI and a hash of everything compiled."""
    digest = hashlib.sha256()
    for path in sorted(source_dir.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (torch.__version__, sys.implementation.cache_tag, platform.machine(),
                 " ".join(CFLAGS), " ".join(LDFLAGS), os.environ.get("CXX", "c++")):
        digest.update(part.encode() + b"\0")
    return f"torch{torch.__version__}-{sys.implementation.cache_tag}-{digest.hexdigest()[:16]}"


def _build(build_dir: Path) -> None:
    """Compile into ``build_dir`` and load the library (one process at a time)."""
    from torch.utils import cpp_extension

    _find_ninja()
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir.parent / f"{build_dir.name}.lock"):
        if (build_dir / BUILT_MARKER).exists():  # another process built it while we waited
            torch.ops.load_library(str(build_dir / f"{LIBRARY_NAME}.so"))
            return
        # Build from a copy, so what is compiled is what was hashed, and clear what a killed
        # build left (torch's own lock file would make cpp_extension wait forever).
        shutil.rmtree(build_dir, ignore_errors=True)
        source_copy = build_dir / "src"
        shutil.copytree(CSRC_DIR, source_copy, ignore=lambda _, names: [
            name for name in names if not name.endswith((".cpp", ".h"))])
        logger.info("cpu backend: compiling the C++ kernels (first use only, about a minute "
                    "on 2 cores; cached in %s)", build_dir)
        start = time.perf_counter()
        cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(source_copy / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        (build_dir / BUILT_MARKER).write_text(f"built in {time.perf_counter() - start:.1f} s\n")
        logger.info("cpu backend: C++ kernels compiled in %.1f s", time.perf_counter() - start)


def _find_ninja() -> None:
    """torch's loader runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency of this
    package) puts it in the environment's scripts folder, which is not on PATH when Python is
    started by its full path without activating the environment."""
    if shutil.which("ninja") is not None:
        return
    candidates = [Path(sys.executable).parent]
    with contextlib.suppress(ImportError):
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            logger.debug("cpu attention: using ninja from %s", folder)
            return


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on ``lock_path`` between processes, released if the holder dies."""
    import fcntl

    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


if __name__ == "__main__":  # `python -m octavo_cpu.kernels` (make install): build or load now
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_kernels()
    print(f"octavo cpu kernels: {loaded.isas if loaded else 'not available (torch path)'}")
