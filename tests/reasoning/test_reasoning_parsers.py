"""Reasoning parsers on what reasoning models write: whole texts, streamed texts, token ids."""

from __future__ import annotations

import pytest
from octavo.hookspecs import hookimpl
from octavo.plugins import build_plugin_manager
from octavo.reasoning import ReasoningParser, get_reasoning_parser, reasoning_parsers

QWEN3_PROMPT = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
# Qwen3 with enable_thinking=False: the template closes an empty block itself.
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
# DeepSeek-R1's template opens the block in the prompt.
R1_PROMPT = "<｜User｜>Why?<｜Assistant｜><think>\n"

# (parser, prompt, generated text, reasoning, content)
CASES = [
    ("qwen3", QWEN3_PROMPT,
     "<think>\nOkay, the user asks why. Rayleigh scattering.\n</think>\n\nBecause of Rayleigh "
     "scattering.",
     "Okay, the user asks why. Rayleigh scattering.", "Because of Rayleigh scattering."),
    ("qwen3", QWEN3_NO_THINK_PROMPT, "Because of Rayleigh scattering.",
     None, "Because of Rayleigh scattering."),
    ("qwen3", QWEN3_PROMPT, "Plain answer, no thinking.", None, "Plain answer, no thinking."),
    # Thinking cut by max_tokens: all reasoning, no answer.
    ("qwen3", QWEN3_PROMPT, "<think>\nStill thinking about", "Still thinking about", None),
    # A tool call after the thinking stays in the answer (the tool parser reads it next).
    ("qwen3", QWEN3_PROMPT,
     '<think>\nI should call get_weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Berlin"}}\n</tool_call>',
     "I should call get_weather.",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'),
    # Multi-line reasoning keeps its inner whitespace.
    ("qwen3", QWEN3_PROMPT, "<think>\nStep 1.\n\nStep 2.\n</think>\n\nDone.",
     "Step 1.\n\nStep 2.", "Done."),
    ("deepseek_r1", R1_PROMPT,
     "Okay, so the sky is blue because...\n</think>\n\nThe sky is blue due to Rayleigh "
     "scattering.",
     "Okay, so the sky is blue because...", "The sky is blue due to Rayleigh scattering."),
    # Older R1 builds repeat the start tag themselves.
    ("deepseek_r1", R1_PROMPT, "<think>\nHmm.\n</think>\n\nAnswer.", "Hmm.", "Answer."),
    # R1 never gives a plain answer: text without the end tag is all reasoning.
    ("deepseek_r1", R1_PROMPT, "Thinking and cut", "Thinking and cut", None),
    ("deepseek_r1", "", "x\n</think>\n\ny", "x", "y"),
]


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_builtin_parsers_are_registered():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parsers())


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*deepseek_r1"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_split(name, prompt, text, reasoning, content):
    assert get_reasoning_parser(name)().split(text, prompt) == (reasoning, content)


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_streamed_adds_up_to_split(name, prompt, text, reasoning, content, size):
    stream = get_reasoning_parser(name)().stream(prompt)
    deltas = [stream.feed(piece) for piece in pieces_of(text, size)] + [stream.finish()]
    assert "".join(d.reasoning for d in deltas) == (reasoning or "")
    assert "".join(d.content for d in deltas) == (content or "")


def test_reasoning_streams_before_the_end_tag():
    stream = get_reasoning_parser("qwen3")().stream(QWEN3_PROMPT)
    assert stream.feed("<think>\nfirst ").reasoning == "first"
    assert stream.in_reasoning
    step = stream.feed("second</th")  # a cut end tag is held back
    assert step.reasoning == " second" and step.content == ""
    step = stream.feed("ink>\n\nanswer")
    assert step.reasoning == "" and step.content == "answer"
    assert not stream.in_reasoning


class _Tokenizer:
    """Words are tokens; the tags are single tokens."""

    vocab = {"<think>": 1, "</think>": 2, "a": 3, "b": 4}

    def encode(self, text, add_special_tokens=False):
        return [self.vocab[w] for w in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        names = {v: k for k, v in self.vocab.items()}
        return " ".join(names[i] for i in ids)


def test_is_reasoning_end_on_token_ids():
    parser = get_reasoning_parser("qwen3")(_Tokenizer())
    assert (parser.start_token_id, parser.end_token_id) == (1, 2)
    assert not parser.is_reasoning_end([3, 1, 3])
    assert parser.is_reasoning_end([3, 1, 3, 2, 4])
    assert not parser.is_reasoning_end([1, 3, 2, 1])  # a second block opened
    assert not parser.is_reasoning_end([3, 4])


class _Plugin:
    @hookimpl
    def octavo_register_reasoning_parsers(self, register):
        class Bracket(ReasoningParser):
            name = "bracket"
            start_tag, end_tag = "[thought]", "[/thought]"

        register("bracket", Bracket)


def test_plugins_add_parsers_through_the_hook():
    pm = build_plugin_manager(load_entry_points=False)
    pm.register(_Plugin())
    parser = get_reasoning_parser("bracket", pm)()
    assert parser.split("[thought] hm [/thought] yes") == ("hm", "yes")
    assert "qwen3" in reasoning_parsers(pm)


def test_the_engine_option_checks_the_name(tiny_llama):
    from octavo.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        EngineArgs(model=str(tiny_llama), reasoning_parser="nope").create_engine_config()
    config = EngineArgs(model=str(tiny_llama), reasoning_parser="qwen3").create_engine_config()
    assert config.model_config.reasoning_parser == "qwen3"
