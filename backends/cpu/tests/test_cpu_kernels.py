"""The CPU backend's C++ kernels (``octavo_cpu.kernels``) against ``octavo.attention.reference``.

Each case is one step as the scheduler builds it: decodes next to fresh prompts and prefill
chunks after a cached prefix, on scattered block tables whose padding points at a block nobody
writes, in a cache allocated full of NaN. Every instruction set this CPU runs is tested
(``CPUKernels.isas``: AVX2 here; AVX-512 and its bf16 variant only on a CPU that has them), in
float32, bfloat16 and float16, with grouped-query, multi-query and multi-head layouts, head
dims 64, 80 and 128, and block sizes 1 to 32. Also: the split of long contexts into parts, the
cache write, strided inputs, the torch fallback (head dims the kernels do not take, and a
machine where they cannot be built), the build cache and the packaging of the sources.

The library is built once (about 20 s on 2 cores) into the user's cache and loaded from there
by every later test and run.
"""

from __future__ import annotations

import logging
import platform
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import octavo_cpu.kernels as kernels_module
import pytest
import torch
from cpu_info import cpu_flags
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import paged_attention_reference, write_kv_reference
from octavo.testing.compare import assert_kernel_close
from octavo.testing.paged_steps import build_workload, workload_cases
from octavo_cpu.attention import CPUAttentionBackend
from octavo_cpu.kernels import CSRC_DIR, SOURCES, build_key, load_kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (tokens already cached, new tokens this step) per sequence.
MIXED = [
    (0, 1),     # one-token prompt
    (9, 1),     # decode, context ends inside a block
    (0, 70),    # prompt longer than a 64-key chunk and than one query tile
    (50, 30),   # prefill chunk after a cached prefix
    (600, 1),   # long decode: many chunks
    (130, 5),   # short chunk after a prefix ending mid-block
    (31, 1),    # decode
]

# (name, num_heads, num_kv_heads, block_size)
LAYOUTS = [
    ("gqa4-bs16", 8, 2, 16),
    ("mqa-bs4", 8, 1, 4),
    ("mha-bs32", 4, 4, 32),
    ("gqa2-bs1", 6, 3, 1),
    ("gqa3-bs16", 9, 3, 16),  # the default model's 3 query heads per KV head: 3-row tiles
]


def _kernels_or_fail():
    kernels = load_kernels()
    if kernels is None:
        if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"):
            pytest.fail("the C++ kernels did not build on x86-64 Linux (see the warning above)")
        pytest.skip(f"no C++ kernels on {sys.platform}/{platform.machine()}")
    return kernels


@pytest.fixture(scope="module")
def kernels():
    return _kernels_or_fail()


# The library has code for avx2, avx512 and avx512bf16; each test runs the ones this CPU has
# (read from /proc/cpuinfo, the same flags the C++ side asks libgcc about), so a machine
# without AVX-512 runs fewer cases instead of skipping some.
_ISA_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512_bf16"},
}


CPU_ISAS = [isa for isa, needed in _ISA_FLAGS.items() if needed <= cpu_flags()]


def test_the_library_detects_the_instruction_sets_the_cpu_reports(kernels):
    assert list(kernels.isas) == CPU_ISAS


def make_step(seqs, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0,
              window=None):
    """A NaN cache holding each sequence's cached prefix, and the step's new Q/K/V. With a
    sliding ``window``, positions before the window of a sequence's first new token stay NaN
    (their blocks may belong to another request by then: a kernel must not read them)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(cached + new) // block_size) for cached, new in seqs]
    num_blocks = 1 + sum(blocks_needed) + 3  # block 0: table padding, never written
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, starts, seq_lens = [], [], [0], []
    for (cached, new), count in zip(seqs, blocks_needed):
        blocks = [free.pop() for _ in range(count)]
        positions = torch.arange(cached + new)
        seq_slots = (torch.tensor(blocks)[positions // block_size] * block_size
                     + positions % block_size)
        first = 0 if window is None else max(0, cached - window + 1)
        if cached > first:  # written by earlier steps
            flat[:, seq_slots[first:cached]] = torch.randn(
                2, cached - first, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots += seq_slots[cached:].tolist()
        tables.append(blocks)
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
    metadata = AttentionMetadata.from_lists(slots, starts, seq_lens, tables)
    num_tokens = starts[-1]
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return query, key, value, kv_cache, metadata


def reference(query, key, value, kv_cache, metadata, scale, window=None, cap=None):
    """The reference on float32 copies of the (already rounded) inputs: (out, cache)."""
    ref_cache = kv_cache.float()
    write_kv_reference(key.float(), value.float(), ref_cache, metadata.slot_mapping)
    out = paged_attention_reference(query.float(), ref_cache, metadata, scale, window, cap)
    return out, ref_cache


def check_kernels(kernels, seqs, *, dtype, num_heads, num_kv_heads, head_dim, block_size,
                  isa="", part_size=0, what="", window=None, cap=None):
    query, key, value, kv_cache, metadata = make_step(
        seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=DTYPES[dtype], window=window)
    scale = head_dim**-0.5
    expected, ref_cache = reference(query, key, value, kv_cache, metadata, scale, window, cap)
    kernels.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    # Exactly the reference's values at the written slots, and NaN wherever nothing was written.
    torch.testing.assert_close(kv_cache.float(), ref_cache, equal_nan=True, atol=0, rtol=0)
    assert torch.isnan(kv_cache).any(), "the test must leave unwritten slots as NaN"
    out = kernels.paged_attention(query, kv_cache, metadata, scale, isa=isa, part_size=part_size,
                                  sliding_window=window, logits_soft_cap=cap)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert_kernel_close(out, expected, dtype, what or f"{isa} {dtype}")
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_mixed_step_matches_reference(kernels, isa, dtype, head_dim, layout):
    name, num_heads, num_kv_heads, block_size = layout
    check_kernels(kernels, MIXED, dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_size=block_size, isa=isa,
                  what=f"{isa} {dtype} d{head_dim} {name}")


@pytest.mark.parametrize("part_size", [64, 192])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_keys_split_into_parts_match_reference(kernels, isa, dtype, part_size):
    """Every tile's keys cut into parts, computed apart and combined (split-K)."""
    check_kernels(kernels, MIXED, dtype=dtype, num_heads=8, num_kv_heads=1, head_dim=64,
                  block_size=16, isa=isa, part_size=part_size,
                  what=f"{isa} {dtype} parts of {part_size}")


# (window, soft cap): a window smaller than a block, one of a few chunks, a cap, both.
WINDOW_OPTIONS = [(5, None), (150, None), (None, 2.0), (70, 1.5)]


@pytest.mark.parametrize(("window", "cap"), WINDOW_OPTIONS,
                         ids=["window5", "window150", "cap2", "window70-cap1.5"])
@pytest.mark.parametrize("part_size", [0, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_sliding_window_and_soft_cap_match_reference(kernels, isa, dtype, part_size, window,
                                                     cap):
    """Positions before each sequence's window are NaN in the cache: never read. Split keys
    (``part_size``) start at the window too."""
    check_kernels(kernels, MIXED, dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64,
                  block_size=16, isa=isa, part_size=part_size, window=window, cap=cap,
                  what=f"{isa} {dtype} window {window} cap {cap} parts {part_size}")


@pytest.mark.parametrize("use_kernels", [True, False], ids=["cpp", "torch"])
def test_window_and_soft_cap_through_the_backend(kernels, use_kernels):
    """``CPUAttentionBackend`` (C++ kernels, and its torch fallback) declares and applies a
    window and a soft cap; head dim 80 and block size 4."""
    backend = CPUAttentionBackend(use_kernels=use_kernels)
    assert backend.supports_sliding_window and backend.supports_logits_soft_cap
    window, cap, head_dim = 11, 3.0, 80
    impl = backend.make_impl(8, 2, head_dim, head_dim**-0.5, sliding_window=window,
                             logits_soft_cap=cap)
    for dtype in ("float32", "bfloat16"):
        query, key, value, kv_cache, metadata = make_step(
            MIXED, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=4,
            dtype=DTYPES[dtype], window=window)
        expected, _ = reference(query, key, value, kv_cache, metadata, impl.scale, window, cap)
        out = impl.forward(query, key, value, kv_cache, metadata)
        assert_kernel_close(out, expected, dtype, f"backend {dtype} kernels={use_kernels}")


def test_soft_cap_saturates_without_overflow(kernels):
    query, key, value, kv_cache, metadata = make_step(
        [(0, 20), (40, 1)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
        dtype=torch.float32)
    query = query * 1e4
    expected, _ = reference(query, key, value, kv_cache, metadata, 0.125, None, 1.0)
    kernels.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    out = kernels.paged_attention(query, kv_cache, metadata, 0.125, logits_soft_cap=1.0)
    assert torch.isfinite(out).all()
    assert_kernel_close(out, expected, "float32", "saturated soft cap")


@pytest.mark.parametrize("num_threads", [1, 2])
def test_thread_counts_and_the_automatic_split(kernels, num_threads):
    """One long decode with one KV head: too few tiles for the threads, so with two threads the
    kernels split its keys on their own; with one they do not. Both match the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for seqs in ([(900, 1)], [(0, 40), (700, 3)], MIXED):
            check_kernels(kernels, seqs, dtype="float32", num_heads=4, num_kv_heads=1,
                          head_dim=128, block_size=16, what=f"{num_threads} threads {seqs}")
    finally:
        torch.set_num_threads(before)


def test_results_do_not_depend_on_the_thread_count(kernels):
    """Without a split each row is summed by one thread in one order: same bits."""
    query, key, value, kv_cache, metadata = make_step(
        MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    kernels.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernels.paged_attention(query, kv_cache, metadata, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("case", ["prefill-then-decode", "chunked-prefill", "shared-prefix"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_step_workloads_through_the_backend(kernels, case, dtype):
    """The conformance kit's workloads (head dim 80, which the kit does not pick) through
    ``CPUAttentionBackend``, cache written by the kernels step after step."""
    head_dim, block_size, num_heads, num_kv_heads = 80, 16, 8, 2
    workload = build_workload(workload_cases(block_size)[case], block_size=block_size,
                              num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=DTYPES[dtype])
    backend = CPUAttentionBackend()
    assert backend.kernels is kernels
    impl = backend.make_impl(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    shape = (2, workload.num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=DTYPES[dtype])
    ref_cache = torch.full(shape, float("nan"))
    for index, step in enumerate(workload.steps):
        q, k, v = (t.to(DTYPES[dtype]) for t in (step.query, step.key, step.value))
        out = impl.forward(q, k, v, kv_cache, step.metadata)
        write_kv_reference(step.key, step.value, ref_cache, step.metadata.slot_mapping)
        expected = paged_attention_reference(step.query, ref_cache, step.metadata, impl.scale)
        assert_kernel_close(out, expected, dtype, f"{case} step {index} {dtype}")
    torch.testing.assert_close(kv_cache.float(), ref_cache, equal_nan=True, atol=0, rtol=0)


def test_strided_inputs_and_key_dtype_conversion(kernels):
    """Q/K/V as slices of one fused projection (strided rows), float32 K/V into a bf16 cache."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    _, _, _, kv_cache, metadata = make_step(
        MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, dtype=torch.bfloat16)
    num_tokens = metadata.num_tokens
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    fused = torch.randn(num_tokens, q_width + 2 * kv_width)
    q = fused.to(torch.bfloat16)[:, :q_width].view(num_tokens, num_heads, head_dim)
    k = fused[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, q_width + kv_width:].view(num_tokens, num_kv_heads, head_dim)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    expected, _ = reference(q, k.to(torch.bfloat16), v.to(torch.bfloat16), kv_cache, metadata,
                            0.125)
    kernels.write_kv_cache(k, v, kv_cache, metadata.slot_mapping)  # float32 into bf16
    out = kernels.paged_attention(q, kv_cache, metadata, 0.125)
    assert_kernel_close(out, expected, "bfloat16", "strided inputs")


def test_sequences_without_new_tokens_and_an_empty_step(kernels):
    """A sequence with no new token this step contributes nothing; an empty step is empty."""
    check_kernels(kernels, [(5, 0), (0, 3), (40, 0), (17, 1)], dtype="float32", num_heads=4,
                  num_kv_heads=2, head_dim=32, block_size=8, what="sequences with 0 tokens")
    query, _, _, kv_cache, _ = make_step([(4, 1)], num_heads=4, num_kv_heads=2, head_dim=32,
                                         block_size=8, dtype=torch.float32)
    empty = AttentionMetadata.from_lists([], [0], [], [])
    out = kernels.paged_attention(query[:0], kv_cache, empty, 0.2)
    assert out.shape == (0, 4, 32)


def test_padding_slots_are_skipped_and_bad_slots_rejected(kernels):
    _, key, value, kv_cache, metadata = make_step(
        [(3, 4)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    before = kv_cache.clone()
    skipped = torch.full_like(metadata.slot_mapping, -1)
    kernels.write_kv_cache(key, value, kv_cache, skipped)
    torch.testing.assert_close(kv_cache, before, equal_nan=True, atol=0, rtol=0)
    too_far = metadata.slot_mapping.clone()
    too_far[1] = kv_cache.shape[1] * kv_cache.shape[2]
    with pytest.raises(RuntimeError, match="past the cache"):
        kernels.write_kv_cache(key, value, kv_cache, too_far)


def test_head_dims_the_kernels_do_not_take_use_torch(kernels):
    """Head dim 40 is no multiple of 16: the backend's torch code serves it, correctly."""
    head_dim = 40
    query, key, value, kv_cache, metadata = make_step(
        MIXED, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=torch.float32)
    assert not kernels.covers(query, kv_cache)
    impl = CPUAttentionBackend().make_impl(8, 2, head_dim, head_dim**-0.5)
    expected, _ = reference(query, key, value, kv_cache, metadata, impl.scale)
    out = impl.forward(query, key, value, kv_cache, metadata)
    assert_kernel_close(out, expected, "float32", "head dim 40 (torch path)")


class _Records(logging.Handler):
    """Collects records of one logger (the octavo tree may not propagate to pytest's)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def kernel_log():
    logger = logging.getLogger("octavo.cpu.kernels")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def fresh_loader():
    """load_kernels() decides again; afterwards the real kernels are found again (cached)."""
    kernels_module.reset_for_tests()
    try:
        yield
    finally:
        kernels_module.reset_for_tests()


def test_falls_back_to_torch_with_one_warning_when_the_build_fails(
        monkeypatch, fresh_loader, kernel_log):
    def no_compiler():
        raise RuntimeError("Error building extension 'octavo_cpu_kernels'\nc++: not found")

    monkeypatch.setattr(kernels_module, "_load_or_build", no_compiler)
    backend = CPUAttentionBackend()
    assert backend.kernels is None
    assert load_kernels() is None  # decided once: no second build attempt, no second warning
    warnings = [r for r in kernel_log if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "torch implementation" in message and "c++: not found" in message
    # The torch path still gives the reference's answer, NaN cache and all.
    impl = backend.make_impl(8, 2, 64, 0.125)
    query, key, value, kv_cache, metadata = make_step(
        MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    expected, _ = reference(query, key, value, kv_cache, metadata, impl.scale)
    out = impl.forward(query, key, value, kv_cache, metadata)
    assert_kernel_close(out, expected, "float32", "torch fallback")


def test_other_machines_are_not_built_for(monkeypatch, fresh_loader, kernel_log):
    def must_not_build():
        raise AssertionError("built on an unsupported machine")

    monkeypatch.setattr(kernels_module, "_load_or_build", must_not_build)
    monkeypatch.setattr(kernels_module.platform, "machine", lambda: "aarch64")
    assert load_kernels() is None
    assert [r.levelno for r in kernel_log] == [logging.INFO]
    assert "x86-64" in kernel_log[0].getMessage()


def test_build_key_follows_the_sources(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC_DIR, copy)
    assert build_key(copy) == build_key(CSRC_DIR)
    header = copy / "common.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert build_key(copy) != build_key(CSRC_DIR)


def test_a_cached_build_loads_in_well_under_a_second(kernels):
    code = (
        "import time, torch\n"
        "from octavo_cpu.kernels import load_kernels\n"
        "start = time.perf_counter()\n"
        "assert load_kernels() is not None\n"
        "print(time.perf_counter() - start)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seconds = float(result.stdout.strip().splitlines()[-1])
    assert seconds < 0.5, f"loading the cached kernels took {seconds:.2f} s"


def test_sources_ship_in_the_wheel(tmp_path):
    """A non-editable install gets the C++ sources as package data."""
    package_dir = tmp_path / "octavo-backend-cpu"  # a copy: the build leaves build/ behind
    shutil.copytree(Path(kernels_module.__file__).parents[2], package_dir,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(package_dir)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("octavo_backend_cpu-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in CSRC_DIR.iterdir():
        if path.suffix in (".cpp", ".h"):
            assert f"octavo_cpu/csrc/{path.name}" in names
    assert all(f"octavo_cpu/csrc/{name}" in names for name in SOURCES)


# A decode batch of the default model's heads (9 query, 3 KV, head dim 64): one head tile per
# sequence (all KV heads at once), with contexts over several chunks and block boundaries.
DECODE_BATCH = [(c, 1) for c in (0, 15, 16, 63, 64, 130, 200, 381)] + [(40, 3)]


@pytest.mark.parametrize("part_size", [0, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_decode_batch_head_tiles_match_reference(kernels, isa, dtype, part_size):
    check_kernels(kernels, DECODE_BATCH, dtype=dtype, num_heads=9, num_kv_heads=3, head_dim=64,
                  block_size=16, isa=isa, part_size=part_size,
                  what=f"{isa} {dtype} head tiles, parts of {part_size}")


_HEAD_TILE_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_cpu_kernels import DECODE_BATCH, MIXED, make_step
from octavo_cpu.kernels import load_kernels
torch.set_num_threads(1)
kernels = load_kernels()
outs = []
for seqs, heads, kv_heads, part in ((DECODE_BATCH, 9, 3, 0), (DECODE_BATCH, 9, 3, 64),
                                    (MIXED, 8, 2, 0)):
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, cache, meta = make_step(seqs, num_heads=heads, num_kv_heads=kv_heads,
                                         head_dim=64, block_size=16, dtype=dtype)
        kernels.write_kv_cache(k, v, cache, meta.slot_mapping)
        outs.append(kernels.paged_attention(q, cache, meta, 0.125, part_size=part))
torch.save(outs, sys.argv[1])
"""


def test_head_tiles_give_the_same_bits_as_one_tile_per_kv_head(tmp_path):
    """Each row is summed in the same order with head tiles (the default) and without
    (``OCTAVO_CPU_ATTENTION_HEAD_TILES=0``, read once per process: two subprocesses)."""
    script = tmp_path / "run.py"
    script.write_text(_HEAD_TILE_SCRIPT.format(tests=str(Path(__file__).parent)))
    results = []
    for setting in ("1", "0"):
        out = tmp_path / f"out{setting}.pt"
        env = dict(os.environ, OCTAVO_CPU_ATTENTION_HEAD_TILES=setting)
        subprocess.run([sys.executable, str(script), str(out)], env=env, check=True,
                       timeout=300)
        results.append(torch.load(out))
    assert len(results[0]) == len(results[1]) == 6
    for on, off in zip(*results):
        assert torch.equal(on, off)
