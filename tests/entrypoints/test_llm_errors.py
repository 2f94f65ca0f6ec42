"""Bad input through ``octavo.LLM``: a clear error naming the value, and the engine unharmed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from octavo.errors import InvalidRequestError
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, token_ids

MAX_MODEL_LEN = 64
PROMPT = "Hello world! hello"


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    # 6 blocks of 16 = 96 tokens: a request of up to 64 fits, more than 96 never could.
    llm = make_llm(tiny_llama, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=6)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    return token_ids(llm.generate(PROMPT, greedy(8), use_tqdm=False))


def assert_engine_still_works(llm, reference) -> None:
    assert_no_leaks(llm)
    assert token_ids(llm.generate(PROMPT, greedy(8), use_tqdm=False)) == reference


def test_prompt_longer_than_max_model_len(llm, reference) -> None:
    with pytest.raises(ValueError, match=f"context length is {MAX_MODEL_LEN} tokens, but the prompt has 70"):
        llm.generate([[20] * 70], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="context length is 64 tokens, but the prompt has 64"):
        llm.generate([[20] * 64], greedy(4), use_tqdm=False)  # no room for one token
    assert_engine_still_works(llm, reference)


def test_empty_prompt(llm, reference) -> None:
    for empty in ("", {"prompt_token_ids": []}):
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate(empty, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([], greedy(4), use_tqdm=False)
    assert_engine_still_works(llm, reference)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -3}, ValueError, "max_tokens must be >= 1, got -3"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an integer, got 2.5"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \[0.0, 1.0\], got 1.5"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"temperature": -0.5}, ValueError, "temperature must be >= 0.0, got -0.5"),
        ({"temperature": float("nan")}, ValueError, "temperature must be a finite number"),
        ({"n": 0}, ValueError, "n must be >= 1, got 0"),
        ({"min_tokens": 9, "max_tokens": 4}, ValueError, r"min_tokens \(9\) must be <= max_tokens"),
        ({"stop": [""]}, ValueError, "stop must be a list of non-empty strings"),
        ({"logprobs": -1}, ValueError, "logprobs must be >= 0, got -1"),
    ],
)
def test_bad_sampling_params(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids(llm, reference) -> None:
    with pytest.raises(ValueError, match=r"prompt token id 384 is out of the vocabulary \[0, 384"):
        llm.generate([[5, 6, 384]], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt token id -1 is out of the vocabulary"):
        llm.generate([[5, -1]], greedy(4), use_tqdm=False)
    with pytest.raises(TypeError, match="prompt token ids must be integers, got '7'"):
        llm.generate({"prompt_token_ids": [5, "7"]}, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"token id 999 in stop_token_ids is out of the vocab") as info:
        llm.generate(PROMPT, greedy(4, stop_token_ids=[999]), use_tqdm=False)
    assert info.value.param == "stop_token_ids"
    with pytest.raises(ValueError, match=r"token id 500 in logit_bias is out of the vocab") as info:
        llm.generate(PROMPT, greedy(4, logit_bias={500: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias"
    assert_engine_still_works(llm, reference)


def test_wrong_types(llm, reference) -> None:
    with pytest.raises(TypeError, match="prompt must be a string, a list of token ids or a dict"):
        llm.generate([3.5], greedy(4), use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .*, got dict"):
        llm.generate(PROMPT, {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(PROMPT, [greedy(4), greedy(4)], use_tqdm=False)
    assert_engine_still_works(llm, reference)


def test_request_that_can_never_fit_the_kv_pool(tiny_llama: Path) -> None:
    small = make_llm(tiny_llama, max_model_len=128, num_gpu_blocks_override=2)  # 32 tokens
    with pytest.raises(InvalidRequestError) as info:
        small.generate(PROMPT, greedy(40), use_tqdm=False)
    message = str(info.value)
    assert "32 tokens (2 blocks of 16)" in message and "max_tokens 40" in message
    assert (info.value.param, info.value.code) == ("max_tokens", "kv_cache_too_small")
    assert_no_leaks(small)
    # In a batch: the request queued before the bad one is withdrawn too.
    with pytest.raises(InvalidRequestError, match="prompt 40 \\+ max_tokens 8"):
        small.generate([PROMPT, [20] * 40], greedy(8), use_tqdm=False)
    assert_no_leaks(small)
    ok = small.generate(PROMPT, greedy(8), use_tqdm=False)
    assert ok[0].outputs[0].finish_reason == "length"


def test_a_bad_prompt_in_a_batch_leaves_no_trace(llm, reference) -> None:
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([PROMPT, PROMPT, [1, 2, 10_000]], greedy(8), use_tqdm=False)
    assert_engine_still_works(llm, reference)


def test_a_failed_request_does_not_disturb_a_running_one(llm, reference) -> None:
    engine = llm.llm_engine
    engine.add_request("good", PROMPT, greedy(8))
    engine.step()
    for bad_prompt, params in [("", greedy(4)), ([9] * 80, greedy(4)),
                               (PROMPT, greedy(4, stop_token_ids=[10**6]))]:
        with pytest.raises(ValueError):
            engine.add_request("bad", bad_prompt, params)
    with pytest.raises(ValueError, match="'good' is already in use"):
        engine.add_request("good", PROMPT, greedy(4))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert token_ids(finished) == reference
    assert_no_leaks(llm)


def test_unknown_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        make_llm(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        make_llm(tmp_path / "empty")


def test_unsupported_architecture(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "opt-ish"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["OPTForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        make_llm(folder)
    message = str(info.value)
    assert "OPTForCausalLM" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM"):
        assert supported in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 100_000}, "max_model_len=100000 is larger than the model's maximum"),
        ({"max_model_len": 0}, "max_model_len must be a positive integer, got 0"),
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"dtype": "float64"}, "dtype 'float64' is not supported"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override must be >= 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
    ],
)
def test_bad_engine_options(tiny_llama: Path, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, **kwargs)
