"""The out-of-tree FlexAttention plugin (``plugins/flex-attention``, ``octavo-plugin-flex-attention``).

It replaces only the cpu backend's attention implementation (``tryfirst`` on
``octavo_attention_backend``) and only when ``OCTAVO_FLEX_ATTENTION`` turns it on. Checked here:
discovery by entry point and the switch; that the engine then runs it on cpu with the cpu
backend's worker and KV layout; kernel results against ``octavo.attention.reference`` (mixed
batches, grouped-query heads, NaN-filled cache, multi-tile sequences, eager and compiled); its
block mask against ``create_block_mask``; and greedy output equal to the cpu backend's own
kernels and to Hugging Face transformers, with prefix caching and chunked prefill.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path

import octavo.plugins
import pytest
import torch
from octavo.attention.base import AttentionMetadata
from octavo.attention.reference import ReferenceAttentionImpl, quantize_kv
from octavo.plugins import build_plugin_manager
from octavo_cpu.attention import CPUAttentionBackend
from octavo_cpu.worker import CPUWorker
from torch.nn.attention.flex_attention import create_block_mask

from tests.entrypoints.test_llm_hf_match import HFReference
from tests.helpers.engine import assert_no_leaks, greedy, make_llm, token_ids
from tests.plugins.conftest import installed_entry_point

ENTRY_POINT = "flex-attention"
HEAD_DIM = 16

# (tokens already cached, new tokens this step) per sequence, as the scheduler mixes them.
MIXED = [
    (9, 1),   # decode, context ends inside a page
    (0, 7),   # fresh prompt
    (12, 5),  # chunk after a cached prefix that ends on a page boundary
    (3, 1),   # short decode
    (0, 1),   # one-token prompt (batched with the decodes)
    (21, 1),  # long decode
    (6, 3),   # chunk after a prefix ending mid-page
]
# Sequences longer than one FlexAttention tile (128): several query and key tiles.
LONG = [(200, 100), (0, 300), (290, 1), (129, 1), (127, 2)]


@pytest.fixture(scope="module", autouse=True)
def entry_point():
    return installed_entry_point(ENTRY_POINT, "octavo-plugin-flex-attention")


@pytest.fixture
def flex_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCTAVO_FLEX_ATTENTION", "1")


@pytest.fixture
def flex_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OCTAVO_FLEX_ATTENTION", raising=False)


@pytest.fixture
def octavo_logs(monkeypatch, caplog):
    """caplog that sees the ``octavo`` tree (``configure_logging`` stops propagation)."""
    monkeypatch.setattr(logging.getLogger("octavo"), "propagate", True)
    return caplog


def _attn_backend(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner.attn_backend


# ---- discovery and the switch -------------------------------------------------------------------


def test_found_by_its_entry_point_and_tryfirst(entry_point):
    import octavo_flex_attention.plugin

    assert entry_point.value == "octavo_flex_attention.plugin"  # packaging: test_packaging.py
    pm = build_plugin_manager()
    assert pm.get_plugin(ENTRY_POINT) is octavo_flex_attention.plugin
    impls = {i.plugin_name: i for i in pm.hook.octavo_attention_backend.get_hookimpls()}
    assert impls[ENTRY_POINT].tryfirst and not impls["cpu"].tryfirst
    # pluggy asks tryfirst implementations first: the plugin before the cpu backend.
    order = [i.plugin_name for i in reversed(pm.hook.octavo_attention_backend.get_hookimpls())]
    assert order.index(ENTRY_POINT) < order.index("cpu")


def test_off_unless_the_env_var_turns_it_on(monkeypatch):
    from octavo_flex_attention.attention import FlexAttentionBackend

    pm = build_plugin_manager()

    def chosen(backend="cpu"):
        return pm.hook.octavo_attention_backend(backend=backend, model_config=None,
                                                cache_config=None)

    for value in (None, "", "0", "off"):
        if value is None:
            monkeypatch.delenv("OCTAVO_FLEX_ATTENTION", raising=False)
        else:
            monkeypatch.setenv("OCTAVO_FLEX_ATTENTION", value)
        assert type(chosen()) is CPUAttentionBackend, value
    for value, name in (("1", "cpu-flex"), ("eager", "cpu-flex"), ("compile", "cpu-flex-compiled")):
        monkeypatch.setenv("OCTAVO_FLEX_ATTENTION", value)
        backend = chosen()
        assert type(backend) is FlexAttentionBackend and backend.name == name, value
    # Only the cpu backend's attention is replaced.
    from octavo_flex_attention import plugin

    assert plugin.octavo_attention_backend(backend="cuda", model_config=None,
                                           cache_config=None) is None
    monkeypatch.setenv("OCTAVO_FLEX_ATTENTION", "fast")
    with pytest.raises(ValueError, match="OCTAVO_FLEX_ATTENTION='fast'.*0 \\(off\\), 1 or eager, compile"):
        chosen()


def test_disable_plugins_keeps_it_from_loading(tiny_llama, flex_on, monkeypatch,
                                               fresh_plugin_manager):
    monkeypatch.setenv("OCTAVO_DISABLE_PLUGINS", ENTRY_POINT)
    llm = make_llm(tiny_llama, device="cpu", num_gpu_blocks_override=32)
    assert octavo.plugins.get_plugin_manager().get_plugin(ENTRY_POINT) is None
    assert type(_attn_backend(llm)) is CPUAttentionBackend


# ---- the engine runs it on cpu ------------------------------------------------------------------


def test_engine_uses_it_on_cpu_with_the_cpu_worker(tiny_llama, flex_on, monkeypatch, octavo_logs):
    from octavo_flex_attention import plugin
    from octavo_flex_attention.attention import FlexAttentionBackend, FlexAttentionImpl

    monkeypatch.setattr(plugin, "_announced", set())
    with octavo_logs.at_level(logging.INFO, logger="octavo"):
        llm = make_llm(tiny_llama, device="cpu", num_gpu_blocks_override=32)
        make_llm(tiny_llama, device="cpu", num_gpu_blocks_override=32)
    announced = [r.getMessage() for r in octavo_logs.records
                 if "flex-attention plugin: cpu attention runs on torch FlexAttention" in r.getMessage()]
    assert len(announced) == 1, announced  # once, not once per engine
    worker = llm.llm_engine.engine_core.executor.worker
    assert type(worker) is CPUWorker  # the rest still comes from the cpu backend
    assert type(_attn_backend(llm)) is FlexAttentionBackend
    layers = [m for m in worker.model.modules() if hasattr(m, "impl")]
    assert layers and all(type(m.impl) is FlexAttentionImpl for m in layers)
    # The cpu backend's KV layout, so its memory sizing and worker hold.
    cpu_shape = CPUAttentionBackend().get_kv_cache_shape(32, 16, 2, HEAD_DIM)
    assert tuple(worker.model_runner.kv_caches[0].shape) == cpu_shape
    assert len(token_ids(llm.generate(["Hello"], greedy(4), use_tqdm=False))[0]) == 4


# ---- kernel level: against octavo.attention.reference ------------------------------------------


def _build_step(seqs, num_kv_heads, dtype, block_size=4, seed=0):
    """A NaN-filled cache holding each sequence's cached prefix on scattered pages, plus the
    metadata of a step adding the new tokens (block 0 stays unused: table padding points at it)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_pages = [-(-(cached + new) // block_size) for cached, new in seqs]
    num_blocks = 1 + sum(num_pages)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, HEAD_DIM), float("nan"),
                          dtype=dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, query_start, seq_lens = [], [], [0], []
    for (cached, new), pages in zip(seqs, num_pages):
        blocks = [free.pop() for _ in range(pages)]
        tables.append(blocks)
        for pos in range(cached + new):
            block, offset = blocks[pos // block_size], pos % block_size
            if pos < cached:  # written by earlier steps
                kv_cache[:, block, offset] = torch.randn(2, num_kv_heads, HEAD_DIM,
                                                         generator=gen).to(dtype)
            else:
                slots.append(block * block_size + offset)
        query_start.append(query_start[-1] + new)
        seq_lens.append(cached + new)
    metadata = AttentionMetadata.from_lists(slots, query_start, seq_lens, tables)
    return kv_cache, metadata, gen


def _run_both(seqs, num_heads, num_kv_heads, dtype, compiled=False, block_size=4, window=None,
              cap=None, fp8_scales=None):
    """``fp8_scales=(k_scale, v_scale)``: the cache is the e4m3 quantization of the random one
    and both impls get those scales."""
    from octavo_flex_attention.attention import FlexAttentionBackend

    kv_cache, metadata, gen = _build_step(seqs, num_kv_heads, dtype, block_size)
    if window is not None:  # positions before each window: NaN (another request's, by now)
        for i, (cached, _) in enumerate(seqs):
            for pos in range(max(0, cached - window + 1)):
                block = int(metadata.block_tables[i, pos // block_size])
                kv_cache[:, block, pos % block_size] = float("nan")
    if fp8_scales is not None:  # NaN stays NaN in e4m3
        kv_cache = torch.stack([quantize_kv(kv_cache[0], fp8_scales[0]),
                                quantize_kv(kv_cache[1], fp8_scales[1])])
    n = metadata.num_tokens
    query = torch.randn(n, num_heads, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    options = {k: v for k, v in (("sliding_window", window), ("logits_soft_cap", cap))
               if v is not None}
    flex = FlexAttentionBackend(compiled=compiled).make_impl(num_heads, num_kv_heads, HEAD_DIM,
                                                             scale, **options)
    ref = ReferenceAttentionImpl(num_heads, num_kv_heads, HEAD_DIM, scale, window, cap)
    if fp8_scales is not None:
        for impl in (flex, ref):
            impl.k_scale, impl.v_scale = fp8_scales
    flex_cache, ref_cache = kv_cache.clone(), kv_cache.clone()
    with torch.inference_mode():  # as the model runner calls it
        out = flex.forward(query, key, value, flex_cache, metadata)
    expected = ref.forward(query, key, value, ref_cache, metadata)
    return out, expected, flex_cache, ref_cache


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_fp32_matches_reference(num_heads, num_kv_heads):
    out, expected, flex_cache, ref_cache = _run_both(MIXED, num_heads, num_kv_heads, torch.float32)
    assert out.shape == expected.shape == (sum(n for _, n in MIXED), num_heads, HEAD_DIM)
    assert torch.isnan(flex_cache).any(), "unused slots must stay uninitialised (NaN) here"
    assert torch.isfinite(out).all(), "NaN from unused cache slots leaked into the output"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Same K/V written to the same slots (NaN == NaN for the untouched ones).
    torch.testing.assert_close(flex_cache, ref_cache, equal_nan=True, atol=0, rtol=0)


def test_mixed_batch_bf16_within_tolerance():
    out, expected, _, _ = _run_both(MIXED, 8, 2, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_sequences_longer_than_one_tile_match_reference():
    out, expected, _, _ = _run_both(LONG, 8, 2, torch.float32, block_size=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "cap"), [(3, None), (40, None), (None, 2.0), (150, 1.5)],
                         ids=["window3", "window40", "cap2", "window150-cap1.5"])
def test_sliding_window_and_soft_cap_match_reference(window, cap):
    """Short and multi-tile sequences; positions before each window are NaN in the cache."""
    for seqs, block_size in ((MIXED, 4), (LONG, 16)):
        out, expected, _, _ = _run_both(seqs, 8, 2, torch.float32, block_size=block_size,
                                        window=window, cap=cap)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "cap"), [(None, None), (3, 1.5), (150, None)],
                         ids=["full", "window3-cap1.5", "window150"])
def test_fp8_cache_matches_reference(window, cap):
    """An fp8 cache read with non-unit scales, alone and with a window and soft cap."""
    for seqs, block_size in ((MIXED, 4), (LONG, 16)):
        out, expected, flex_cache, ref_cache = _run_both(
            seqs, 8, 2, torch.float32, block_size=block_size, window=window, cap=cap,
            fp8_scales=(0.5, 0.3))
        assert flex_cache.dtype == torch.float8_e4m3fn
        assert torch.equal(flex_cache.view(torch.uint8), ref_cache.view(torch.uint8))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # inductor compiles the fused C++ kernel: ~25 s on two cores
def test_compiled_kernel_matches_reference():
    out, expected, _, _ = _run_both(MIXED + LONG, 8, 2, torch.float32, compiled=True,
                                    block_size=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 20, 150], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("tile", [16, 128])
@pytest.mark.parametrize("q_len,kv_len", [(100, 304), (1, 304), (7, 32)])
def test_block_mask_equals_create_block_mask(tile, q_len, kv_len, window):
    """The analytic BlockMask lists the same partial and full tiles as evaluating the mask."""
    from octavo_flex_attention.block_mask import causal_prefix_block_mask, causal_prefix_mask_mod

    seq_lens = torch.tensor([kv_len, 1, 77, 129, max(q_len, kv_len - 48)])
    query_lens = torch.minimum(seq_lens, torch.tensor(q_len))
    context_lens = seq_lens - query_lens
    mine = causal_prefix_block_mask(context_lens, seq_lens, q_len, kv_len, tile, window)
    ref = create_block_mask(causal_prefix_mask_mod(context_lens, seq_lens, window),
                            len(seq_lens), None, q_len, kv_len, device="cpu", BLOCK_SIZE=tile)
    assert torch.equal(mine.to_dense(), ref.to_dense())
    for count, indices in (("kv_num_blocks", "kv_indices"),
                           ("full_kv_num_blocks", "full_kv_indices")):
        assert torch.equal(getattr(mine, count), getattr(ref, count)), count
        counts = getattr(mine, count).flatten().tolist()
        mine_idx = getattr(mine, indices).flatten(0, 2)
        ref_idx = getattr(ref, indices).flatten(0, 2)
        for row, n in enumerate(counts):
            assert mine_idx[row, :n].tolist() == ref_idx[row, :n].tolist(), (indices, row)


# ---- end to end: the cpu backend's kernels and Hugging Face -------------------------------------

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "Caf\u00e9 cr\u00e8me and \u65e5\u672c",
]
NUM_TOKENS = 12


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_cpu_kernels_and_hf(arch, tiny_model_factory, monkeypatch):
    folder = tiny_model_factory(arch)
    params = greedy(NUM_TOKENS, logprobs=3)
    monkeypatch.delenv("OCTAVO_FLEX_ATTENTION", raising=False)
    builtin = make_llm(folder, device="cpu", num_gpu_blocks_override=64)
    assert type(_attn_backend(builtin)) is CPUAttentionBackend
    expected = builtin.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setenv("OCTAVO_FLEX_ATTENTION", "1")
    llm = make_llm(folder, device="cpu", num_gpu_blocks_override=64)
    assert _attn_backend(llm).name == "cpu-flex"
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_no_leaks(llm)
    assert token_ids(outputs) == token_ids(expected)
    for got, want in zip(outputs, expected):
        for got_pos, want_pos in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert set(got_pos) == set(want_pos)
            for token_id, logprob in got_pos.items():
                assert logprob.logprob == pytest.approx(want_pos[token_id].logprob, abs=1e-4)
    hf = HFReference(folder)
    assert token_ids(outputs) == [hf.greedy(p, NUM_TOKENS)[0] for p in PROMPTS]


def test_prefix_caching_and_chunked_prefill_give_the_same_tokens(tiny_llama, flex_on):
    """Chunks after a cached prefix (prefix hits, 16-token chunks) against whole prompts."""
    shared = "The capital of France is Paris. The capital of Japan is Tokyo. " * 2
    prompts = [shared + "Once upon a time", shared + "def add(a, b):", shared + "Hello world"]
    params = greedy(6)
    whole = make_llm(tiny_llama, device="cpu", num_gpu_blocks_override=64,
                     enable_prefix_caching=False, enable_chunked_prefill=False)
    expected = token_ids(whole.generate(prompts, params, use_tqdm=False))
    chunked = make_llm(tiny_llama, device="cpu", num_gpu_blocks_override=64,
                       enable_prefix_caching=True, max_num_batched_tokens=16)
    assert _attn_backend(chunked).name == "cpu-flex"
    first = chunked.generate(prompts[:1], params, use_tqdm=False)
    assert len(first[0].prompt_token_ids) > 2 * 16, "the prompt must take several chunks"
    rest = chunked.generate(prompts[1:], params, use_tqdm=False)
    assert chunked.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_stats.hits > 0
    assert_no_leaks(chunked)
    assert token_ids(first + rest) == expected


# ---- the backend conformance kit, with the plugin switched on -----------------------------------


@pytest.mark.slow  # the kit's engine tests take ~100 s on two cores with eager FlexAttention
def test_cpu_conformance_kit_passes_with_flex_attention():
    """``pytest --octavo-backend cpu --pyargs octavo.testing.conformance`` in a fresh process,
    with ``OCTAVO_FLEX_ATTENTION=1``: every check passes and the plugin's kernels did the work."""
    from octavo.testing import run_conformance

    repo = Path(__file__).resolve().parents[2]
    pythonpath = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    report = run_conformance(
        "cpu", "-p", "tests.plugins.flex_call_counter",
        env={"OCTAVO_FLEX_ATTENTION": "1", "PYTHONPATH": pythonpath}, timeout_s=850,
    )
    assert report.ok, report.summary()
    assert {"test_attention", "test_engine_equivalence", "test_hf_equivalence"} <= report.modules
    calls = re.search(r"flex-attention forward calls: (\d+)", report.output)
    assert calls is not None and int(calls.group(1)) > 0, report.summary()
