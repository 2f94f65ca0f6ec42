"""Tool-call parsers on what real models write: whole texts and the same texts streamed.

Every realistic output is parsed whole (``extract``) and streamed in pieces of every size from
one character up; the streamed deltas must add up to the whole parse (same content, same calls,
the call's id and name in its first delta only). Malformed calls come back as content.
"""

from __future__ import annotations

import json
import random

import pluggy
import pytest
from octavo import hookspecs
from octavo.entrypoints.openai.tool_parsers import (
    ToolParser,
    ToolParserDelta,
    get_tool_parser,
    tool_parsers,
)
from octavo.entrypoints.openai.tool_parsers.forced import JsonToolCallsParser
from octavo.hookspecs import hookimpl
from octavo.plugins import build_plugin_manager

WEATHER = {"location": "San Francisco, CA, USA", "unit": "celsius"}

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    # Qwen2.5-Instruct: one call, nothing else.
    ("hermes",
     '<tool_call>\n{"name": "get_current_temperature", "arguments": '
     '{"location": "San Francisco, CA, USA"}}\n</tool_call>',
     None, [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    # Qwen2.5: content, then two parallel calls.
    ("hermes",
     'Let me check both.\n<tool_call>\n{"name": "get_current_temperature", "arguments": '
     '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
     '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
     "Let me check both.",
     [("get_current_temperature", WEATHER),
      ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01",
                                "unit": "celsius"})]),
    # Hermes-2-Pro writes the arguments before the name; nested values, escapes, unicode.
    ("hermes",
     '<tool_call>\n{"arguments": {"query": "caf\\u00e9 \\"Le Nord\\"", "filters": '
     '{"open": true, "price": [1, 2.5e1, null]}}, "name": "search"}\n</tool_call>',
     None, [("search", {"query": 'café "Le Nord"', "filters": {"open": True,
                                                                "price": [1, 25.0, None]}})]),
    # A call cut by max_tokens after its JSON: the closing tag is optional.
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}', None, [("ping", {})]),
    # No arguments key at all.
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    # Plain answers, one mentioning the tag's look-alike.
    ("hermes", "The weather is sunny, 21 C.", "The weather is sunny, 21 C.", []),
    ("hermes", "Use <tool_cal> carefully.", "Use <tool_cal> carefully.", []),
    # Llama 3.1 JSON tool calling: a bare object with "parameters".
    ("llama3_json",
     '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
     '"unit": "Fahrenheit"}}',
     None, [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    # Llama 3.2: after <|python_tag|>, several calls separated by semicolons.
    ("llama3_json",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
     '{"name": "get_time", "parameters": {"timezone": "Europe/Rome"}}',
     None, [("get_weather", {"city": "Rome"}), ("get_time", {"timezone": "Europe/Rome"})]),
    ("llama3_json", "I cannot call tools for that.", "I cannot call tools for that.", []),
    # A JSON answer that is not a call (no name) stays content.
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    # Mistral-7B-Instruct-v0.3: [TOOL_CALLS] then a JSON array.
    ("mistral",
     '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
     '"format": "celsius"}}, {"name": "get_current_weather", "arguments": {"location": '
     '"Lyon, France", "format": "celsius"}}]',
     None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_current_weather", {"location": "Lyon, France", "format": "celsius"})]),
    # Mistral Small 3.2 / Magistral: name[ARGS]{...} per call, content before it.
    ("mistral",
     'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e'
     '[ARGS]{"timezone": "Europe/Paris"}',
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("mistral", "Bonjour !", "Bonjour !", []),
    # Cut by max_tokens after a complete call: the array's end is optional.
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    # What the structured-output engine shapes for tool_choice "required" and a named function.
    ("json", '[{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}},'
             '{"name":"get_time","arguments":{"timezone":"Asia/Tokyo"}}]',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_time", {"timezone": "Asia/Tokyo"})]),
    ("json", '{"name":"get_weather","arguments":{"city":"Oslo","unit":"fahrenheit"}}',
     None, [("get_weather", {"city": "Oslo", "unit": "fahrenheit"})]),
]

MALFORMED = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n'
               '</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}'),  # cut inside the object
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2}}'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}} {"name": "g", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}"),  # a name with a space
]


def parser_cls(name: str) -> type[ToolParser]:
    return JsonToolCallsParser if name == "json" else get_tool_parser(name)


def stream(cls: type[ToolParser], pieces: list[str]) -> list[ToolParserDelta]:
    parser = cls()
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def calls_of(extracted) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls]


def test_builtin_parsers_are_registered():
    assert {"hermes", "llama3_json", "mistral"} <= set(tool_parsers())


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_extract_realistic_outputs(name, text, content, calls):
    extracted = parser_cls(name).extract(text)
    assert extracted.content == content
    assert calls_of(extracted) == calls
    ids = [c.id for c in extracted.tool_calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":  # Mistral's templates need 9 alphanumeric characters
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streaming_adds_up_to_the_whole_parse(name, text, content, calls, size):
    deltas = stream(parser_cls(name), pieces_of(text, size))
    streamed_content = "".join(d.content for d in deltas)
    assert streamed_content == (content or "")
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index not in names:  # a call's first delta carries its id and name
                assert call.id is not None and call.name is not None
                names[call.index] = call.name
                arguments[call.index] = ""
            else:
                assert call.id is None and call.name is None
            arguments[call.index] += call.arguments
    assert sorted(names) == list(range(len(calls)))
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls


def test_arguments_stream_before_the_call_ends():
    """A client sees the arguments grow while the model writes them."""
    parser = get_tool_parser("hermes")()
    first = parser.feed('<tool_call>\n{"name": "search", "arguments": {"query": "long')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("search", '{"query": "long')]
    second = parser.feed(' text"}}\n</tool_call>')
    assert [(d.index, d.id, d.arguments) for d in second.tool_calls] == [(0, None, ' text"}')]


def test_a_tag_split_between_pieces_is_held_back():
    parser = get_tool_parser("hermes")()
    assert parser.feed("Hi <tool").content == "Hi"  # the space may precede a call: held
    out = parser.feed('_call>{"name": "f", "arguments": {}}</tool_call>')
    out += parser.finish()
    assert out.content == "" and [d.name for d in out.tool_calls] == ["f"]


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_are_content(name, text):
    extracted = parser_cls(name).extract(text)
    assert extracted.tool_calls == []
    assert extracted.content == text


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_streamed_give_no_half_call(name, text):
    """Streamed, the text comes back too: whatever of a call was not given out as a call
    (its name not complete yet) is given back as content."""
    deltas = stream(parser_cls(name), pieces_of(text, 1))
    content = "".join(d.content for d in deltas)
    sent = [c for d in deltas for c in d.tool_calls]
    if not sent:
        assert content == text
    else:  # a call whose name was already streamed: its arguments stop where they broke
        assert all(c.name is None or c.name in text for c in sent)


def test_random_splits_match_whole_parse():
    rng = random.Random(0)
    for name, text, content, calls in CASES:
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(text)), k=min(5, len(text) - 1)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            deltas = stream(parser_cls(name), pieces)
            assert "".join(d.content for d in deltas) == (content or "")
            assert len({c.index for d in deltas for c in d.tool_calls}) == len(calls)


class _BracketParser(ToolParser):
    """A plugin's format: ``!!{"name": ..., "arguments": ...}`` anywhere in the text."""

    name = "bang"

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False

    def _step(self, final: bool) -> bool:
        if not self._in_call:
            if not self._content_until("!!", final):
                return False
            self._begin_call(raw="!!")
            self._in_call = True
            return True
        if self._read_object():
            self._end_call()
            self._in_call = False
            return True
        return False


class _Plugin:
    @hookimpl
    def octavo_register_tool_parsers(self, register):
        register("bang", _BracketParser)
        register("hermes", _BracketParser)  # a plugin may replace a built-in parser


def test_plugins_add_and_replace_parsers_through_the_hook():
    pm = build_plugin_manager(load_entry_points=False)
    pm.register(_Plugin())
    parsers = tool_parsers(pm)
    assert parsers["bang"] is _BracketParser and parsers["hermes"] is _BracketParser
    assert parsers["mistral"].name == "mistral"
    extracted = get_tool_parser("bang", pm).extract('Ok !!{"name": "f", "arguments": {"x": 1}}')
    assert extracted.content == "Ok" and calls_of(extracted) == [("f", {"x": 1})]


def test_the_hook_refuses_what_is_not_a_parser():
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)

    class Bad:
        @hookimpl
        def octavo_register_tool_parsers(self, register):
            register("bad", dict)

    pm.register(Bad())
    with pytest.raises(TypeError, match="must be a subclass"):
        tool_parsers(pm)
