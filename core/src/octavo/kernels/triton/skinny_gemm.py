"""Launch configs of the small-M kernels (``fp8_gemv``, ``int4_gemv``, ``gguf_gemv``,
``dense_gemv``) and their tuner.

The kernels give each program ``block_n`` output features and a range of the inputs: the
grid is ``[cdiv(N, block_n), split_k]``. With ``split_k > 1`` the programs add float32 partial
sums into a per-device workspace (``tl.atomic_add``) and the last program of each block of
outputs stores the total in the activations' dtype and zeroes the workspace again
(``SkinnyOutput``, ``SplitKWorkspace``: one kernel per call, where a zeroed buffer before and
a cast after made three; a launch during graph capture without a workspace made before it
takes the zeroed buffer); with 1 they store the result directly. ``split_k = 0`` asks
``choose_split_k`` to split until about two programs per SM stream the weight.

``SkinnyTuner`` picks a config per (kernel, N, K, row bucket, dtype, ...) and device:

1. from the device's config table when it has the case: ``configs/skinny_<GPU name>.json``
   next to this module (vLLM's practice for its Triton MoE configs), written by
   ``benchmarks/gpu/bench_quant_gemv.py --sweep --write-configs``, which times every candidate
   inside a CUDA graph over enough weight copies that L2 holds none (as in a model's forward).
   The same config in every process: timing at start-up picked a different one of several
   near-equal configs in each process, and batch-1 decode moved with it by up to 0.3 ms per
   token on the 8B shape (docs/benchmarks.md). A GPU without a table of its own takes the
   table of another GPU of the same chip (the same compute capability and number of SMs, as
   the H200 and the H100: their kernels differ only in memory speed), which a table records
   under ``"chip"``; where both exist, a case missing from the GPU's own table is taken from
   the other's. ``OCTAVO_SKINNY_CONFIG_TABLES=0`` ignores the tables;
   ``OCTAVO_SKINNY_CONFIG_DIR`` reads the tables of another folder instead (a fresh sweep's,
   for an A/B run);
2. else the first time the shape is seen outside CUDA-graph capture, by timing a few
   candidates (whole calls, on a flushed L2 via
   ``triton.testing.do_bench``), kept for the process;
3. else (during capture, under the interpreter, with tuning off) the kernel's heuristic
   default, timing nothing. ``SkinnyTuner.lookup`` does 1 then 3, never timing: for a kernel
   whose start-up timing picks worse than its default (``octavo_cuda.int4_mma``).

The decode graph runner runs every batch size once eagerly before capturing it
(``octavo.worker.cuda_graph``), so the captured kernels use tuned configs.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from octavo import envs
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
    # The one-row loops under PDL (``dense_gemv``): let the next kernel launch once the first
    # tile's loads are issued (True) or after the K loop (False); also ``fp8_gemv``'s.
    early_trigger: bool = True
    # The one-row loops of ``dense_gemv`` and ``fp8_gemv``: sum each step's products over
    # each thread's 16-byte runs of inputs before accumulating, so the per-lane sums hold
    # ``block_n * block_k / run`` floats, not one per weight (``one_row_sums``).
    sum_runs: bool = False
    # The one-row loops (``dense_gemv``, ``fp8_gemv``, ``int4_gemv``): K steps whose weight
    # loads are in flight at once, copied ahead through shared memory (``tl.range``'s
    # ``num_stages``: the K loop is software-pipelined); 0 or 1: each step's loads are
    # issued when the step starts. ``num_stages`` is the ``tl.dot`` paths' (2 to 16 rows).
    load_stages: int = 0


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
    than ``target_programs`` and each program keeps at least two K steps; then cut to the
    programs that get inputs (``k_per_split`` rounds each one's range up to whole steps, so
    16 splits of 38 steps cover K with 13): a program with an empty range would still run
    the one-row loops' first step, peeled to load before the PDL wait, reading ``x`` and
    scales past K."""
    split = config.split_k
    if not split:
        blocks = triton.cdiv(n, config.block_n)
        steps = triton.cdiv(k, config.block_k)
        target = target_programs(device)
        split = 1
        while blocks * split * 2 <= target and steps // (split * 2) >= 2:
            split *= 2
    return triton.cdiv(k, k_per_split(k, split, config.block_k))


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SplitKWorkspace:
    """Float32 partial sums and int32 arrival counts shared by the split-K launches of the
    small-M kernels on one device (``store_skinny_output``'s ``IN_KERNEL_SUM``).

    Contract: both are zero between launches (allocated zeroed; each launch's last program
    per block of outputs leaves its part at zero), so the kernels of a device must run one
    after another on one stream, as the model's forward does (two launches in flight at once
    would mix their counts). Grown only outside CUDA-graph capture (a buffer zeroed inside a
    capture would be zero only once that graph had replayed), to at least ``MIN_SUMS`` /
    ``MIN_BLOCKS`` so a model's shapes fit the first one; a replaced workspace is kept alive
    (captured graphs hold its address).
    """

    MIN_SUMS = 1 << 20  # floats: M x N up to 16 rows x 65,536 outputs
    MIN_BLOCKS = 1 << 14

    def __init__(self) -> None:
        # By device: (sums, arrivals).
        self.current: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Replaced workspaces, never freed.
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get(self, device: torch.device, sums: int,
            blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers of at least ``sums`` floats and ``blocks`` counts on ``device``, or
        ``None`` when they would have to be allocated during graph capture."""
        have = self.current.get(device)
        if have is not None and have[0].numel() >= sums and have[1].numel() >= blocks:
            return have
        if capturing(device):
            return None
        sums = max(sums, self.MIN_SUMS, have[0].numel() if have else 0)
        blocks = max(blocks, self.MIN_BLOCKS, have[1].numel() if have else 0)
        if have is not None:
            self.retired.append(have)
        made = (torch.zeros(sums, dtype=torch.float32, device=device),
                torch.zeros(blocks, dtype=torch.int32, device=device))
        self.current[device] = made
        return made


SPLIT_K_WORKSPACE = SplitKWorkspace()


@functools.cache
def in_kernel_sum() -> bool:
    """``OCTAVO_SKINNY_IN_KERNEL_SUM``, read once per process (launches are on the host's hot
    path)."""
    return envs.skinny_in_kernel_sum()


@dataclass(frozen=True, slots=True)
class SkinnyOutput:
    """Where one small-M launch writes (``store_skinny_output``'s arguments)."""

    # The kernel's ``out_ptr``: the result in the activations' dtype, or (a split without a
    # workspace) float32 zeros to add into.
    out: torch.Tensor
    # ``sums_ptr`` / ``arrivals_ptr`` (``out`` when unused).
    sums: torch.Tensor
    arrivals: torch.Tensor
    # The kernel's ``IN_KERNEL_SUM``.
    in_kernel_sum: bool
    # The result's dtype.
    dtype: torch.dtype

    @classmethod
    def make(cls, m: int, n: int, block_n: int, split: int, dtype: torch.dtype,
             device: torch.device) -> SkinnyOutput:
        """The output of an ``[M, N]`` launch of ``split`` programs per block of ``block_n``
        outputs: the workspace's in-kernel sum where it can be had (outside graph capture, or
        with a workspace made before it)."""
        workspace = (SPLIT_K_WORKSPACE.get(device, m * n, triton.cdiv(n, block_n))
                     if split > 1 and in_kernel_sum()
                     else None)
        if split == 1 or workspace is not None:
            out = torch.empty(m, n, dtype=dtype, device=device)
            sums, arrivals = workspace if workspace is not None else (out, out)
            return cls(out, sums, arrivals, workspace is not None, dtype)
        out = torch.zeros(m, n, dtype=torch.float32, device=device)
        return cls(out, out, out, False, dtype)

    def result(self) -> torch.Tensor:
        """The ``[M, N]`` result in ``dtype`` (after the launch)."""
        return self.out if self.out.dtype == self.dtype else self.out.to(self.dtype)


def k_per_split(k: int, split_k: int, block_k: int) -> int:
    """Inputs each program of a split covers: a whole number of ``block_k`` steps."""
    return triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k


#: Where the per-device config tables live (package data of octavo-core).
CONFIG_DIR = Path(__file__).parent / "configs"


def tune_key(**fields: object) -> str:
    """The case a config is chosen for, as the tables spell it: ``"n=6144,k=4096,m=1,
    dtype=bfloat16"`` (fields in the caller's order; torch dtypes without ``torch.``)."""
    return ",".join(f"{name}={str(value).removeprefix('torch.')}"
                    for name, value in fields.items())


def config_table_path(device_name: str) -> Path:
    """The config table of GPUs named ``device_name`` (``torch.cuda.get_device_name``)."""
    return CONFIG_DIR / f"skinny_{device_name.replace(' ', '_')}.json"


def read_config_table(path: Path) -> dict[str, dict[str, SkinnyConfig]]:
    """``{kernel: {tune_key: config}}`` from a table file (``{"kernels": {kernel: {key:
    {"block_n": ..., ...}}}}``); a file that does not parse is an error naming it."""
    try:
        data = json.loads(path.read_text())
        return {kernel: {key: SkinnyConfig(**fields) for key, fields in entries.items()}
                for kernel, entries in data["kernels"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _unreadable(path, exc) from exc


def _unreadable(path: Path, exc: Exception) -> ValueError:
    return ValueError(f"skinny kernel config table {path} is not readable ({exc}); fix or "
                      "delete it, or set OCTAVO_SKINNY_CONFIG_TABLES=0")


def chip_of(properties: Any) -> dict[str, object]:
    """What a config table records of the GPU it was tuned on, beyond its name, to serve
    GPUs of the same chip (``properties``: ``torch.cuda.get_device_properties``)."""
    return {"compute_capability": f"{properties.major}.{properties.minor}",
            "multi_processor_count": properties.multi_processor_count}


def find_config_tables(device_name: str, chip: dict[str, object],
                       config_dir: Path = CONFIG_DIR) -> list[tuple[Path, bool]]:
    """The tables for a GPU named ``device_name`` whose ``chip_of`` is ``chip``, in the order
    their cases count: its own first, then (by file name) those of other GPUs of the same
    chip; each as ``(path, is_its_own)``. A table that does not parse is an error naming it
    (``read_config_table``)."""
    own = config_dir / config_table_path(device_name).name
    found = [(own, True)] if own.is_file() else []
    for path in sorted(config_dir.glob("skinny_*.json")):
        if path == own:
            continue
        try:
            recorded = json.loads(path.read_text()).get("chip")
        except (OSError, ValueError) as exc:
            raise _unreadable(path, exc) from exc
        if recorded == chip:
            found.append((path, False))
    return found


def merge_config_tables(
        tables: Sequence[dict[str, dict[str, SkinnyConfig]]]) -> dict[str, dict[str, SkinnyConfig]]:
    """One table of every case in ``tables``; a case in several takes the first one's config
    (a GPU's own sweep over its chip-mates'; kernels swept on only one of them still count)."""
    merged: dict[str, dict[str, SkinnyConfig]] = {}
    for table in tables:
        for kernel, entries in table.items():
            into = merged.setdefault(kernel, {})
            for key, config in entries.items():
                into.setdefault(key, config)
    return merged


@functools.cache
def _device_table(device_index: int) -> dict[str, dict[str, SkinnyConfig]]:
    if not envs.skinny_config_tables():
        return {}
    name = torch.cuda.get_device_name(device_index)
    chip = chip_of(torch.cuda.get_device_properties(device_index))
    config_dir = envs.skinny_config_dir()
    found = find_config_tables(name, chip, Path(config_dir) if config_dir else CONFIG_DIR)
    table = merge_config_tables([read_config_table(path) for path, _ in found])
    for path, own in found:
        if own:
            logger.info("small-M kernels: launch configs from %s", path.name)
        else:
            logger.info("small-M kernels: launch configs from %s for cases %s has none of its "
                        "own (tuned on the same chip: compute capability %s, %s SMs)",
                        path.name, name, chip["compute_capability"],
                        chip["multi_processor_count"])
    return table


class SkinnyTuner:
    """Per-process choice of ``SkinnyConfig``: table, timing or default (module docstring)."""

    def __init__(self, name: str) -> None:
        # The kernel's name: its section of the config tables.
        self.name = name
        # Chosen configs by (tune_key, device).
        self.best: dict[tuple[str, torch.device], SkinnyConfig] = {}
        # Whether ``choose`` times candidates at all (tests and benchmarks switch it off).
        self.enabled = True

    def lookup(self, key: str, device: torch.device, default: SkinnyConfig) -> SkinnyConfig:
        """The config for case ``key`` on ``device``: from the device's table, else
        ``default``; never timed (for kernels whose start-up timing picks worse than their
        default)."""
        found = self.best.get((key, device))
        if found is None:
            found = self._from_table(key, device) or default
            self.best[(key, device)] = found
        return found

    def _from_table(self, key: str, device: torch.device) -> SkinnyConfig | None:
        if device.type != "cuda" or interpreting():
            return None
        return _device_table(device.index or 0).get(self.name, {}).get(key)

    def choose(self, key: str, device: torch.device, default: SkinnyConfig,
               candidates: Sequence[SkinnyConfig],
               run: Callable[[SkinnyConfig], object]) -> SkinnyConfig:
        """The config for case ``key`` (``tune_key``) on ``device``: chosen already, from the
        device's table, timed now (``run(config)`` for each candidate), or ``default`` when
        timing is not possible here."""
        found = self.best.get((key, device))
        if found is not None:
            return found
        if device.type != "cuda" or interpreting():
            return default
        found = self._from_table(key, device)
        if found is not None:
            self.best[(key, device)] = found
            return found
        if not self.enabled or torch.cuda.is_current_stream_capturing():
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
        self.best[(key, device)] = best
        logger.debug("%s %s: %s (%.1f us)", self.name, key, best,
                     min(t[0] for t in timings) * 1e3 if timings else float("nan"))
        return best
