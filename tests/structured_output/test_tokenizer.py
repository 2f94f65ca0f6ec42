"""``GrammarTokenizer``: the tokenizer as data, and its codec against ``transformers``'."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from octavo.structured_output.tokenizer import GrammarTokenizer, load_grammar_tokenizer

TEXTS = ["<think>\nthe user wants the weather\n</think>\n\n", '{"city": "Paris", "n": 3}',
         "<|im_start|>assistant\n<tool_call>", "  spaces,  and punctuation . ! ?", "ünïcödé 東京"]


@pytest.fixture(scope="module")
def hf_tokenizer(tool_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


def test_the_codec_encodes_and_decodes_as_transformers_does(hf_tokenizer) -> None:
    codec = GrammarTokenizer.from_transformers(hf_tokenizer, {0}).text_codec()
    for text in TEXTS:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert codec.encode(text, add_special_tokens=False) == ids
        for skip in (False, True):
            assert (codec.decode(ids, skip_special_tokens=skip)
                    == hf_tokenizer.decode(ids, skip_special_tokens=skip))


def test_it_travels_as_msgpack_without_padding(tool_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    tokenizer.backend_tokenizer.enable_padding(length=16)
    grammar_tokenizer = GrammarTokenizer.from_transformers(tokenizer, {7, 2})
    assert grammar_tokenizer.eos_token_ids == (2, 7)
    assert '"padding":null' in grammar_tokenizer.tokenizer_json.replace(" ", "")
    assert tokenizer.backend_tokenizer.padding is not None  # the model's own keeps its own
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(grammar_tokenizer),
                                     type=GrammarTokenizer)
    assert decoded == grammar_tokenizer


def test_the_engines_loader_reads_the_models_eos_ids(tool_model: Path) -> None:
    from octavo.engine.arg_utils import EngineArgs
    from transformers import AutoTokenizer

    model_config = EngineArgs(model=str(tool_model), device="cpu").create_engine_config(
    ).model_config
    grammar_tokenizer = load_grammar_tokenizer(model_config)
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    assert tokenizer.eos_token_id in grammar_tokenizer.eos_token_ids
    assert grammar_tokenizer.llguidance_tokenizer(len(tokenizer)).vocab_size == len(tokenizer)


def test_a_slow_tokenizer_is_a_clear_error() -> None:
    class SlowTokenizer:  # what a sentencepiece-only transformers tokenizer offers: no backend
        pass

    with pytest.raises(ValueError, match="fast tokenizer"):
        GrammarTokenizer.from_transformers(SlowTokenizer(), {0})
