"""``Processor``: the one validator of requests. Every refusal is an ``InvalidRequestError``
naming the field and a code; accepted requests become ``EngineCoreRequest``s whose own
``SamplingParams`` carry the completion's effective seed and max_tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from octavo.backends.backend import BackendCapabilities
from octavo.engine.processor import KVCacheCapacity, Processor, child_seed
from octavo.errors import InvalidRequestError, InvalidRequestTypeError
from octavo.sampling_params import SamplingParams

VOCAB = 100
MAX_LEN = 32
EOS = {2}


class _Tokenizer:
    def __call__(self, text):
        return SimpleNamespace(input_ids=[3 + (ord(c) % 90) for c in text])


def make(clip: bool = True, capabilities: BackendCapabilities | None = None, max_logprobs: int = 5):
    model_config = SimpleNamespace(vocab_size=VOCAB, max_model_len=MAX_LEN,
                                   max_logprobs=max_logprobs, max_n=4)
    backend = "npu" if capabilities is not None else None
    return Processor(model_config, _Tokenizer(), EOS, backend=backend, capabilities=capabilities,
                     clip_max_tokens=clip)


def refused(processor: Processor, prompt, params: SamplingParams) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        processor.process("r", prompt, params)
    return info.value


@pytest.mark.parametrize("prompt, params, param, code", [
    ([], SamplingParams(), "prompt", "empty_prompt"),
    ("", SamplingParams(), "prompt", "empty_prompt"),
    ([5, VOCAB], SamplingParams(), "prompt", "invalid_value"),
    ([5, -1], SamplingParams(), "prompt", "invalid_value"),
    ([5] * MAX_LEN, SamplingParams(), "prompt", "context_length_exceeded"),
    ("ok \ud800", SamplingParams(), "prompt", "invalid_text"),
    ([5], SamplingParams(stop=["a\udc00"]), "stop", "invalid_text"),
    ([5], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids", "invalid_value"),
    ([5], SamplingParams(logit_bias={VOCAB + 3: 1.0}), "logit_bias", "invalid_value"),
    ([5], SamplingParams(logprobs=6), "logprobs", "invalid_value"),
    ([5], SamplingParams(prompt_logprobs=9), "prompt_logprobs", "invalid_value"),
    ({"text": "x"}, SamplingParams(), "prompt", "invalid_value"),
    ([5], SamplingParams(n=5), "n", "too_many"),
    ([5], SamplingParams(stop=[f"s{i}" for i in range(129)]), "stop", "too_many"),
    ([5], SamplingParams(stop=["x" * 1025]), "stop", "too_many"),
])
def test_every_check_names_its_field_and_code(prompt, params, param, code):
    error = refused(make(), prompt, params)
    assert (error.param, error.code) == (param, code), error.message
    assert isinstance(error, ValueError)


def test_wrong_types_are_type_errors_too():
    for prompt in ([5, True], [5, "7"], 3.5):
        error = refused(make(), prompt, SamplingParams())
        assert isinstance(error, InvalidRequestTypeError) and isinstance(error, TypeError)
        assert error.param == "prompt"
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        make().process("r", [5], {"temperature": 0})


def test_max_tokens_is_clipped_offline_and_refused_online():
    prompt, params = [5] * 30, SamplingParams(max_tokens=10, min_tokens=5)
    (core,) = make(clip=True).process("r", prompt, params).core_requests
    assert core.sampling_params.max_tokens == 2  # the room left in max_model_len
    assert core.sampling_params.min_tokens == 2
    error = refused(make(clip=False), prompt, params)
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    assert "maximum context length is 32 tokens, but 40 were requested" in error.message
    assert make(clip=False).process("r", prompt, SamplingParams(max_tokens=None)).core_requests[
        0].sampling_params.max_tokens == 2  # unset: all the room there is


def test_a_request_that_never_fits_the_kv_cache_is_refused():
    processor = make()
    processor.kv_cache = KVCacheCapacity(num_blocks=2, block_size=8)  # 16 tokens
    error = refused(processor, [5] * 10, SamplingParams(max_tokens=7))
    assert (error.param, error.code) == ("max_tokens", "kv_cache_too_small")
    assert "16 tokens (2 blocks of 8)" in error.message
    assert "prompt 10 + max_tokens 7" in error.message
    processor.process("r", [5] * 10, SamplingParams(max_tokens=6))  # exactly 2 blocks


def test_backend_capabilities_are_checked_with_the_field():
    caps = BackendCapabilities(prompt_logprobs=False, max_logprobs=2)
    error = refused(make(capabilities=caps), [5], SamplingParams(logprobs=3))
    assert (error.param, error.code) == ("logprobs", "unsupported_by_backend")
    error = refused(make(capabilities=caps), [5], SamplingParams(prompt_logprobs=0))
    assert error.param == "prompt_logprobs"


def test_completions_carry_their_own_seed_and_limits():
    params = SamplingParams(n=3, seed=7, max_tokens=4, prompt_logprobs=1)  # n within max_n (4)
    processed = make().process("req", [5, 6], params)
    children = [r.sampling_params for r in processed.core_requests]
    assert [r.request_id for r in processed.core_requests] == ["0_req", "1_req", "2_req"]
    assert [c.seed for c in children] == [child_seed(7, i, 3) for i in range(3)]
    assert len({c.seed for c in children}) == 3
    assert all(c.n == 1 and c.max_tokens == 4 and c.all_stop_token_ids == EOS for c in children)
    assert [c.prompt_logprobs for c in children] == [1, None, None]  # computed once
    assert processed.params.seed == 7 and processed.params.n == 3  # the user's, as given
    (single,) = make().process("one", [5], SamplingParams(seed=7)).core_requests
    assert single.request_id == "one" and single.sampling_params.seed == 7


def test_sampling_params_errors_carry_the_field():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_p=2.0)
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequestTypeError) as info:
        SamplingParams(top_k="many")
    assert info.value.param == "top_k" and isinstance(info.value, TypeError)


def test_process_any_runs_a_beam_search_or_sampling_and_refuses_a_beam_search_with_lora():
    from octavo.lora_request import LoRARequest
    from octavo.sampling_params import BeamSearchParams

    processor = make()
    beams = processor.process_any("b", [5, 6], BeamSearchParams(beam_width=2, max_tokens=4))
    sampled = processor.process_any("s", [5, 6], SamplingParams(max_tokens=4, n=2))
    assert len(beams.core_requests) == 1 and beams.core_requests[0].beam_search is not None
    assert len(sampled.core_requests) == 2
    with pytest.raises(InvalidRequestError, match="LoRA adapter") as info:
        processor.process_any("c", [5, 6], BeamSearchParams(beam_width=2, max_tokens=4),
                              lora_request=LoRARequest("sql", 1, "/adapters/sql"))
    assert info.value.param == "lora_request"
