"""The out-of-tree GPT-2 model plugin (``plugins/gpt2``, distribution ``octavo-plugin-gpt2``).

Found only through its entry point; on a tiny random GPT-2 its greedy ids and logprobs equal
Hugging Face transformers' (fp32), in a batch, with chunked prefill and prefix caching; without
the plugin the architecture is unsupported and the error says which.
"""

from __future__ import annotations

import math

import pytest
import torch
from octavo.config import ModelConfig
from octavo.model_executor.model_loader import resolve_model_class
from octavo.plugins import build_plugin_manager

from tests.entrypoints.test_llm_hf_match import HFReference, assert_position_logprobs
from tests.helpers.engine import assert_no_leaks, greedy, make_llm, token_ids
from tests.plugins.conftest import installed_entry_point

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):\n    return",
    "Caf\u00e9 cr\u00e8me and \u65e5\u672c",
    "Hello",
]
NUM_TOKENS = 20
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def entry_point():
    return installed_entry_point("gpt2", "octavo-plugin-gpt2")


@pytest.fixture(scope="module")
def hf(tiny_gpt2) -> HFReference:
    return HFReference(tiny_gpt2)


@pytest.fixture(scope="module")
def llm(entry_point, tiny_gpt2):
    llm = make_llm(tiny_gpt2, device="cpu", num_gpu_blocks_override=64)
    yield llm
    llm.llm_engine.shutdown()


def test_found_by_its_entry_point_only(entry_point, tiny_gpt2):
    import octavo_gpt2.plugin
    from octavo_gpt2.model import GPT2LMHeadModel

    assert entry_point.value == "octavo_gpt2.plugin"  # packaging: test_packaging.py
    pm = build_plugin_manager()
    assert pm.get_plugin("gpt2") is octavo_gpt2.plugin
    model_config = ModelConfig(
        model=str(tiny_gpt2), gguf_file=None, model_dir=tiny_gpt2,
        hf_config=_hf_config(tiny_gpt2), dtype=torch.float32, max_model_len=512,
    )
    assert resolve_model_class(model_config, pm) is GPT2LMHeadModel
    # The core reads GPT-2's n_head / n_embd / n_layer / n_positions through the config's
    # attribute_map, with no GPT-2 knowledge of its own.
    assert (model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
            model_config.num_layers) == (4, 4, 16, 2)


def _hf_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def test_engine_runs_the_plugin_model(llm):
    from octavo_gpt2.model import GPT2LMHeadModel

    worker = llm.llm_engine.engine_core.executor.worker
    assert type(worker.model) is GPT2LMHeadModel
    assert llm.llm_engine.config.model_config.max_model_len == 512  # n_positions


def test_greedy_and_logprobs_match_hf(llm, hf):
    outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS, logprobs=5), use_tqdm=False)
    assert_no_leaks(llm)
    for prompt, output in zip(PROMPTS, outputs):
        expected_ids, expected_logprobs = hf.greedy(prompt, NUM_TOKENS)
        completion = output.outputs[0]
        assert output.prompt_token_ids == hf.ids(prompt)
        assert completion.token_ids == expected_ids, prompt
        assert len(completion.logprobs) == NUM_TOKENS
        for i, (position, token_id) in enumerate(zip(completion.logprobs, expected_ids)):
            assert_position_logprobs(position, expected_logprobs[i], token_id, 5)
            assert position[token_id].rank == 1
        cumulative = sum(expected_logprobs[i, t].item() for i, t in enumerate(expected_ids))
        assert math.isclose(completion.cumulative_logprob, cumulative, abs_tol=NUM_TOKENS * 1e-4)


def test_prompt_logprobs_match_hf(llm, hf):
    outputs = llm.generate(PROMPTS, greedy(2, prompt_logprobs=3), use_tqdm=False)
    assert_no_leaks(llm)
    for prompt, output in zip(PROMPTS, outputs):
        ids = hf.ids(prompt)
        reference = hf.prompt_logprobs(prompt)
        assert len(output.prompt_logprobs) == len(ids) and output.prompt_logprobs[0] is None
        for position, target, expected in zip(output.prompt_logprobs[1:], ids[1:], reference):
            assert_position_logprobs(position, expected, target, 3)


def test_chunked_prefill_and_prefix_caching_match_hf(entry_point, tiny_gpt2, hf):
    """Long prompts sharing a prefix, prefilled in 16-token chunks: learned positions and the
    cached prefix must line up exactly as in one HF forward."""
    shared = "The capital of France is Paris. The capital of Japan is Tokyo. " * 3
    prompts = [shared + "Once upon a time", shared + "def add(a, b):", shared + "Hello"]
    llm = make_llm(tiny_gpt2, device="cpu", num_gpu_blocks_override=64,
                   max_num_batched_tokens=16, enable_prefix_caching=True)
    first = token_ids(llm.generate(prompts[:1], greedy(12), use_tqdm=False))
    rest = token_ids(llm.generate(prompts[1:], greedy(12), use_tqdm=False))
    stats = llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_stats
    assert_no_leaks(llm)
    assert stats.hits > 0, "the shared prefix was not served from the cache"
    for prompt, ids in zip(prompts, first + rest):
        assert ids == hf.greedy(prompt, 12)[0], prompt


def test_unsupported_without_the_plugin(entry_point, tiny_gpt2, monkeypatch, fresh_plugin_manager):
    monkeypatch.setenv("OCTAVO_DISABLE_PLUGINS", "gpt2")
    with pytest.raises(ValueError, match=r"Model architecture\(s\) \[GPT2LMHeadModel\] not "
                                         r"supported.*octavo_register_models"):
        make_llm(tiny_gpt2, device="cpu", num_gpu_blocks_override=16)
