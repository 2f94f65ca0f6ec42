"""Capability negotiation through ``octavo.LLM``: a configuration the selected backend does not
support fails at start-up, a request it does not support fails at admission, both with a
``ValueError`` saying what to do, and the engine is unharmed.

The backend is ``tests.helpers.restricted_backend`` (float32, 16-token blocks, at most 8
sequences of 128 tokens, no prompt logprobs, at most 2 top logprobs), registered on the
engine's plugin manager for the module and unregistered after it.
"""

from __future__ import annotations

from pathlib import Path

import octavo
import pytest
from octavo.attention.reference import ReferenceAttentionBackend
from octavo.backends import BackendNotAvailableError, UnsupportedByBackendError
from octavo.hookspecs import hookimpl
from octavo.plugins import get_plugin_manager
from octavo.sampling_params import SamplingParams

from tests.helpers import restricted_backend
from tests.helpers.engine import assert_no_leaks, greedy, make_llm, token_ids

RESTRICTED = restricted_backend.BACKEND_NAME
# Options every start-up of the restricted backend needs (its max_num_seqs is 8).
OK_OPTIONS = {"device": RESTRICTED, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def restricted():
    """The restricted backend on the engine's plugin manager for this module."""
    pm = get_plugin_manager()
    name = pm.register(restricted_backend, name="test-restricted")
    pm.check_pending()
    try:
        yield restricted_backend.CAPABILITIES
    finally:
        pm.unregister(name=name)


@pytest.fixture(scope="module")
def llm(restricted, tiny_llama: Path):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=64, **OK_OPTIONS)
    yield llm
    llm.llm_engine.shutdown()


# ---- start-up ------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"dtype": "bfloat16"}, "dtype bfloat16 (supported: float32). Use --dtype float32"),
    ({"block_size": 32}, "block_size 32 (supported: 16). Use --block-size 16"),
    ({"max_num_seqs": 256}, "max_num_seqs 256 (supported: at most 8). Use --max-num-seqs 8"),
    ({"max_model_len": 256}, "max_model_len 256 (supported: at most 128). Use --max-model-len 128"),
])
def test_an_unsupported_option_fails_at_start_up(restricted, tiny_llama, options, message):
    with pytest.raises(UnsupportedByBackendError) as info:
        make_llm(tiny_llama, num_gpu_blocks_override=64, **{**OK_OPTIONS, **options})
    text = str(info.value)
    assert text.startswith(f"backend 'restricted' does not support {message} or ")
    # The CPU backend runs everywhere and takes any of these (a GPU backend may be named too).
    assert text.endswith(".") and " or --device cpu" in text


def test_the_default_max_model_len_is_lowered_to_the_backends(llm):
    # The tiny model allows 512 tokens; the backend 128.
    assert llm.llm_engine.config.model_config.max_model_len == 128
    assert llm.llm_engine.config.backend_capabilities == restricted_backend.CAPABILITIES


def test_a_replaced_attention_implementation_is_checked_too(restricted, tiny_llama):
    """A plugin that swaps in kernels with fewer head sizes is caught when the model loads."""

    class Head64Only(ReferenceAttentionBackend):
        name = "head64-only"

        def supported_head_dims(self):
            return (64,)

    class Override:
        @hookimpl(tryfirst=True)
        def octavo_attention_backend(self, backend, model_config, cache_config):
            return Head64Only() if backend == RESTRICTED else None

    pm = get_plugin_manager()
    name = pm.register(Override(), name="test-head64-override")
    try:
        with pytest.raises(UnsupportedByBackendError) as info:
            make_llm(tiny_llama, num_gpu_blocks_override=64, **OK_OPTIONS)
    finally:
        pm.unregister(name=name)
    assert str(info.value).startswith(
        "attention implementation 'head64-only' of backend 'restricted' does not support "
        "head_dim 16, the model's attention head size (supported: 64).")


def test_an_installed_but_unavailable_backend_says_why(tiny_llama):
    from octavo_cuda.plugin import probe_cuda

    answer = probe_cuda()
    if answer.available:
        pytest.skip(f"CUDA is available here ({answer.reason}); this checks a machine without")
    with pytest.raises(BackendNotAvailableError) as info:
        octavo.LLM(str(tiny_llama), device="cuda")
    assert str(info.value) == f"Backend 'cuda' is installed but not available here: {answer.reason}"


# ---- admission -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return token_ids(llm.generate("Hello world", greedy(6), use_tqdm=False))


def assert_engine_still_works(llm, reference) -> None:
    assert_no_leaks(llm)
    assert token_ids(llm.generate("Hello world", greedy(6), use_tqdm=False)) == reference


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=4, logprobs=3),
     ("logprobs must be at most 2 on backend 'restricted' (the most it returns per token), "
      "got 3")),
    (SamplingParams(max_tokens=4, prompt_logprobs=0),
     "prompt_logprobs are not supported by backend 'restricted'"),
    (SamplingParams(max_tokens=4, n=3, logprobs=5), "logprobs must be at most 2"),
])
def test_a_request_beyond_the_backend_is_refused(llm, reference, params, message):
    with pytest.raises(UnsupportedByBackendError) as info:
        llm.generate(["Hello world", "Once upon a time"], params, use_tqdm=False)
    assert str(info.value).startswith(message)
    assert_engine_still_works(llm, reference)


def test_a_prompt_beyond_the_backends_context_is_refused(llm, reference):
    with pytest.raises(ValueError,
                       match="maximum context length is 128 tokens, but the prompt has 200"):
        llm.generate([[20] * 200], greedy(4), use_tqdm=False)
    # A prompt that fits gets the rest of the backend's 128 tokens at most.
    (output,) = llm.generate([[20] * 120], greedy(50), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    assert output.outputs[0].finish_reason == "length"
    assert_engine_still_works(llm, reference)


def test_a_request_within_the_limits_runs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    (output,) = llm.generate("Hello world", params, use_tqdm=False)
    logprobs = output.outputs[0].logprobs
    assert len(logprobs) == 4
    # The sampled token plus the 2 most likely ones (the sampled one may be among them).
    assert all(2 <= len(position) <= 3 for position in logprobs)
    assert_no_leaks(llm)
