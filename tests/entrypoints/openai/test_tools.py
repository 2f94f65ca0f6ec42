"""Tool calling and reasoning output on a real server, through the official ``openai`` client.

The model is ``tests/helpers/tool_model.py``'s: a tiny Qwen2 trained to answer a few
conversations with tool calls (Hermes, Llama 3 JSON and Mistral formats), think blocks and
plain text, so the server's parsers read text the engine really generated. ``"required"`` and
named tool choices are enforced by the structured-output engine: their arguments must parse
and validate against the tool's schema whatever the model would have written.
"""

from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess
from tests.helpers.tool_model import CASES, R1_TEMPLATE_FILE, TIME_TOOL, TOOLS, WEATHER_TOOL

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def messages_of(case: str) -> list[dict]:
    return CASES[case].messages


def _serve(model, *args):
    srv = ServerProcess(model, *args)
    try:
        yield srv
    finally:
        assert srv.stop(signal.SIGINT) == 0


@pytest.fixture(scope="module")
def hermes_server(tool_model):
    """Hermes calls and Qwen3 think tags, the Qwen2.5/Qwen3 setup."""
    yield from _serve(tool_model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def mistral_server(tool_model):
    """Mistral's markers are special tokens, kept in the text for the parser only."""
    yield from _serve(tool_model, "--enable-auto-tool-choice", "--tool-call-parser", "mistral")


def client_of(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def client(hermes_server):
    with client_of(hermes_server) as c:
        yield c


def create(client, case: str, **kwargs):
    kwargs.setdefault("tools", CASES[case].tools)
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=SERVED_NAME, messages=messages_of(case),
                                          temperature=0.0, **kwargs)


def stream_final(client, case: str, **kwargs):
    """The message rebuilt by the client's own stream helper from the streamed deltas."""
    kwargs.setdefault("tools", CASES[case].tools)
    kwargs.setdefault("max_tokens", 80)
    with client.chat.completions.stream(model=SERVED_NAME, messages=messages_of(case),
                                        temperature=0.0, **kwargs) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def content_of(message) -> str | None:
    """The message's content; None for none (streamed, the role chunk's "" starts it)."""
    return message.content or None


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# ---- tool_choice "auto": the model's own calls, parsed ------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_auto_one_call(client, streamed):
    resp = (stream_final if streamed else create)(client, "paris")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert content_of(choice.message) is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")


@pytest.mark.parametrize("streamed", [False, True])
def test_auto_parallel_calls(client, streamed):
    resp = (stream_final if streamed else create)(client, "tokyo")
    assert calls_of(resp.choices[0].message) == [
        ("get_weather", {"city": "Tokyo", "unit": "celsius"}),
        ("get_time", {"timezone": "Asia/Tokyo"})]
    ids = [c.id for c in resp.choices[0].message.tool_calls]
    assert len(set(ids)) == 2


@pytest.mark.parametrize("streamed", [False, True])
def test_parallel_tool_calls_false_keeps_the_first(client, streamed):
    resp = (stream_final if streamed else create)(client, "tokyo", parallel_tool_calls=False)
    assert calls_of(resp.choices[0].message) == [
        ("get_weather", {"city": "Tokyo", "unit": "celsius"})]


def test_streamed_deltas_have_openais_shape(client):
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=messages_of("tokyo"), tools=TOOLS, temperature=0.0,
        max_tokens=80, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    seen: dict[int, dict] = {}
    for choice in deltas:
        for call in choice.delta.tool_calls or []:
            if call.index not in seen:
                assert call.id and call.type == "function" and call.function.name
                seen[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
            seen[call.index]["arguments"] += call.function.arguments or ""
    assert sorted(seen) == [0, 1]
    assert [json.loads(seen[i]["arguments"]) for i in (0, 1)] == [
        {"city": "Tokyo", "unit": "celsius"}, {"timezone": "Asia/Tokyo"}]
    assert deltas[-1].finish_reason == "tool_calls"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert not any(d.delta.content for d in deltas)  # no raw <tool_call> text leaks


def test_no_call_is_plain_content(client):
    resp = create(client, "hello")
    assert resp.choices[0].message.content == "Hello! How can I help?"
    assert not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


def test_call_and_result_round_trip_through_the_template(client):
    """The assistant's call and the tool's answer are sent back; the model answers from them."""
    resp = create(client, "paris_result")
    assert resp.choices[0].message.content == "It is 21 degrees in Paris."
    assert resp.choices[0].finish_reason == "stop"
    # The call the server returned, sent back as is, renders the same conversation.
    first = create(client, "paris")
    history = [*messages_of("paris"), first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                "content": '{"temperature": 21}'}]
    again = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=TOOLS,
                                           temperature=0.0, max_tokens=40)
    assert again.choices[0].message.content == "It is 21 degrees in Paris."


def test_tool_choice_none_leaves_the_text(client):
    resp = create(client, "paris", tool_choice="none")
    assert resp.choices[0].message.content == CASES["paris"].answer
    assert not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"


# ---- reasoning ----------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_reasoning_content_is_split_out(client, streamed):
    if streamed:
        stream = client.chat.completions.create(
            model=SERVED_NAME, messages=messages_of("sky"), temperature=0.0, max_tokens=80,
            stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = create(client, "sky", tools=openai.NOT_GIVEN).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning == "Blue light scatters more."
    assert content == "Because of Rayleigh scattering."


@pytest.mark.parametrize("streamed", [False, True])
def test_reasoning_then_a_tool_call(client, streamed):
    resp = (stream_final if streamed else create)(client, "berlin")
    message = resp.choices[0].message
    if not streamed:  # the stream helper does not keep reasoning_content
        assert message.reasoning_content == "I should call get_weather."
    assert content_of(message) is None
    assert calls_of(message) == [("get_weather", {"city": "Berlin", "unit": "celsius"})]
    assert resp.choices[0].finish_reason == "tool_calls"


# ---- forced choices: the structured-output engine shapes the answer -----------------------------

# With --reasoning-parser the constraint starts after the thinking; a model that may think can
# also answer at once. Thinking off (Qwen3's switch: an empty think block closed in the
# prompt) makes the whole output the constrained answer.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def assert_valid_calls(message, names):
    calls = calls_of(message)
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("case", ["paris", "hello", "sky"])
def test_required_always_gives_valid_calls(client, case, streamed):
    resp = (stream_final if streamed else create)(client, case, tools=TOOLS,
                                                  tool_choice="required", max_tokens=120,
                                                  extra_body=NO_THINKING)
    assert resp.choices[0].finish_reason == "tool_calls"
    assert content_of(resp.choices[0].message) is None
    assert_valid_calls(resp.choices[0].message, set(SCHEMAS))


def test_required_without_parallel_calls_gives_one(client):
    resp = create(client, "tokyo", tool_choice="required", parallel_tool_calls=False,
                  max_tokens=120, extra_body=NO_THINKING)
    assert len(assert_valid_calls(resp.choices[0].message, set(SCHEMAS))) == 1


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("tool", [WEATHER_TOOL, TIME_TOOL])
def test_named_function_is_called(client, tool, streamed):
    name = tool["function"]["name"]
    resp = (stream_final if streamed else create)(
        client, "hello", tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=120, extra_body=NO_THINKING)
    assert resp.choices[0].finish_reason == "tool_calls"
    calls = assert_valid_calls(resp.choices[0].message, {name})
    assert len(calls) == 1


def test_named_function_with_nested_schema_and_refs(client):
    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "$defs": {"day": {"type": "string", "enum": ["mon", "tue"]}},
        "properties": {"days": {"type": "array", "items": {"$ref": "#/$defs/day"},
                                "minItems": 1, "maxItems": 2},
                       "guests": {"type": "integer", "minimum": 1, "maximum": 4},
                       "note": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
        "required": ["days", "guests", "note"], "additionalProperties": False}}}
    resp = create(client, "hello", tools=[tool, *TOOLS],
                  tool_choice={"type": "function", "function": {"name": "book"}}, max_tokens=120,
                  extra_body=NO_THINKING)
    (name, arguments), = calls_of(resp.choices[0].message)
    assert name == "book"
    jsonschema.validate(arguments, tool["function"]["parameters"])


@pytest.mark.parametrize("streamed", [False, True])
def test_required_call_comes_after_the_thinking(client, streamed):
    """The model thinks first (it learned to for this request): the thinking is its own, and
    the constrained call follows the end tag."""
    kwargs = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 120}
    if streamed:
        stream = client.chat.completions.create(
            model=SERVED_NAME, messages=messages_of("berlin"), temperature=0.0, stream=True,
            **kwargs)
        chunks = [c for c in stream if c.choices]
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                            for c in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
        message = stream_final(client, "berlin", **kwargs).choices[0].message
    else:
        resp = create(client, "berlin", **kwargs)
        message, finish_reason = resp.choices[0].message, resp.choices[0].finish_reason
        reasoning = getattr(message, "reasoning_content", None)
    assert reasoning == "I should call get_weather."
    assert finish_reason == "tool_calls"
    assert content_of(message) is None
    assert_valid_calls(message, set(SCHEMAS))


@pytest.mark.parametrize("thinking", [True, False])
def test_a_json_constraint_shapes_the_answer_not_the_thinking(client, thinking):
    """Compact JSON (``disable_any_whitespace``): with the grammar's default whitespace this
    model, never trained on JSON, may spend every token on whitespace between two keys, which
    the grammar allows (it did on 2026-12-01 without thinking: ``{"color"`` and 115 tokens of
    tabs and newlines). ``response_format``
    takes the same constraint path (``test_structured_outputs.py``)."""
    schema = {"type": "object", "properties": {"color": {"type": "string",
                                                         "enum": ["blue", "red"]}},
              "required": ["color"], "additionalProperties": False}
    constraint = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    resp = client.chat.completions.create(
        model=SERVED_NAME, messages=messages_of("sky"), temperature=0.0, max_tokens=120,
        extra_body=constraint if thinking else {**constraint, **NO_THINKING})
    message = resp.choices[0].message
    assert getattr(message, "reasoning_content", None) == (
        "Blue light scatters more." if thinking else None)
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), schema)


# ---- other parsers -----------------------------------------------------------------------------


def test_mistral_markers(mistral_server, tool_model):
    with client_of(mistral_server) as c:
        resp = create(c, "oslo_mistral")
        message = resp.choices[0].message
        assert calls_of(message) == [("get_weather", {"city": "Oslo", "unit": "celsius"})], message
        assert content_of(message) is None  # nor the EOS text the kept special tokens bring
        assert resp.choices[0].finish_reason == "tool_calls"
        assert all(len(call.id) == 9 and call.id.isalnum() for call in message.tool_calls)
        final = stream_final(c, "oslo_mistral")
        assert calls_of(final.choices[0].message) == calls_of(message)
        assert content_of(final.choices[0].message) is None
        # Special tokens stay hidden from answers without calls.
        hello = create(c, "hello")
        assert hello.choices[0].message.content == "Hello! How can I help?"


def test_llama3_json_parser(tool_model):
    for srv in _serve(tool_model, "--enable-auto-tool-choice", "--tool-call-parser",
                      "llama3_json"):
        with client_of(srv) as c:
            for streamed in (False, True):
                resp = (stream_final if streamed else create)(c, "rome_llama3")
                message = resp.choices[0].message
                assert calls_of(message) == [("get_weather", {"city": "Rome", "unit": "celsius"})]
                assert content_of(message) is None
                assert resp.choices[0].finish_reason == "tool_calls"


# ---- bad input: 400 naming the field, and the server goes on ------------------------------------


def post(server, body):
    return httpx.post(f"{server.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


BASE = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WEATHER = WEATHER_TOOL


@pytest.mark.parametrize("fields, param, contains", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name", "name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "not a valid function name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", ""),
    ({"tools": []}, "tools", "must not be empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_mood"}}},
     "tool_choice.function.name", "get_mood"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id", "tool_call_id"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set 'tools'"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "variable name"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(40)}}, "chat_template_kwargs",
     "at most 32"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not JSON"),
])
def test_bad_tool_input_is_400_and_the_server_goes_on(hermes_server, fields, param, contains):
    resp = post(hermes_server, {**BASE, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert contains in error["message"], error
    ok = post(hermes_server, {**BASE, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60,
                              "temperature": 0.0, "parallel_tool_calls": False, **NO_THINKING})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["tool_calls"]


def test_auto_without_a_parser_is_vllms_400(tool_model):
    """A server started without --enable-auto-tool-choice refuses "auto" with vLLM's message
    (clients look for it); "none", "required" and named choices still work. Its template is
    DeepSeek-R1's, which opens the think block in the prompt."""
    for srv in _serve(tool_model, "--chat-template", str(tool_model / R1_TEMPLATE_FILE),
                      "--reasoning-parser", "deepseek_r1"):
        with client_of(srv) as c:
            sky = create(c, "sky_r1", tools=openai.NOT_GIVEN).choices[0].message
            assert (sky.reasoning_content, sky.content) == (
                "Blue light scatters more.", "Because of Rayleigh scattering.")
        resp = post(srv, {**BASE, "tools": TOOLS})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in resp.json()["error"]["message"]
        for choice in ("none", "required", {"type": "function", "function": {"name": "get_time"}}):
            resp = post(srv, {**BASE, "tools": TOOLS, "tool_choice": choice, "max_tokens": 60})
            assert resp.status_code == 200, resp.text


def test_offline_chat_passes_tools_to_the_template(tool_model):
    """``LLM.chat(tools=...)`` renders the tools as the server does: the same greedy text."""
    from octavo import SamplingParams

    from tests.helpers.engine import make_llm

    llm = make_llm(tool_model)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=80)
        out = llm.chat(messages_of("paris"), params, tools=TOOLS, use_tqdm=False)[0]
        assert out.outputs[0].text == CASES["paris"].answer
        out = llm.chat(messages_of("paris"), params, use_tqdm=False)[0]  # no tools shown
        assert out.outputs[0].text != CASES["paris"].answer
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_smollm2_forced_choices_always_parse(smollm2_gguf):
    """A real small instruct model (SmolLM2-135M, whose template ignores tools): "required"
    and named choices still give calls that parse and match the schemas, streamed or not."""
    for srv in _serve(smollm2_gguf, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"):
        with client_of(srv) as c:
            messages = [{"role": "user", "content": "What's the weather like in Rome today?"}]
            named = {"type": "function", "function": {"name": "get_time"}}
            for streamed, choice in ((False, "required"), (True, named)):
                kwargs = dict(model=SERVED_NAME, messages=messages, tools=TOOLS,
                              tool_choice=choice, temperature=0.0, max_tokens=100,
                              parallel_tool_calls=False)
                if streamed:
                    with c.chat.completions.stream(**kwargs) as stream:
                        for _ in stream:
                            pass
                        resp = stream.get_final_completion()
                else:
                    resp = c.chat.completions.create(**kwargs)
                names = {"get_time"} if isinstance(choice, dict) else set(SCHEMAS)
                assert resp.choices[0].finish_reason == "tool_calls", resp
                assert len(assert_valid_calls(resp.choices[0].message, names)) == 1
            # "auto": whatever the model writes is either content or calls that parse.
            resp = c.chat.completions.create(model=SERVED_NAME, messages=messages, tools=TOOLS,
                                             temperature=0.0, max_tokens=16)
            message = resp.choices[0].message
            assert message.content or message.tool_calls
            for call in message.tool_calls or []:
                json.loads(call.function.arguments)
