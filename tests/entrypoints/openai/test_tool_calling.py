"""``tool_choice`` resolved into a plan, and the JSON schemas that enforce a forced choice."""

from __future__ import annotations

import json

import jsonschema
import pytest
from octavo.entrypoints.openai.errors import OpenAIError
from octavo.entrypoints.openai.protocol import ChatCompletionRequest
from octavo.entrypoints.openai.tool_calling import (
    check_tools,
    named_schema,
    plan_tool_calls,
    required_schema,
)
from octavo.entrypoints.openai.tool_parsers import get_tool_parser
from octavo.entrypoints.openai.tool_parsers.forced import JsonToolCallsParser
from octavo.sampling_params import SamplingParams, StructuredOutputsParams
from octavo.structured_output.grammar import validate

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}},
           "required": ["street"]}
SHIP = {"type": "function", "function": {"name": "ship", "parameters": {
    "type": "object", "$defs": {"address": ADDRESS},
    "properties": {"to": {"$ref": "#/$defs/address"}, "from": {"$ref": "#/$defs/address"},
                   "express": {"type": "boolean"}},
    "required": ["to"], "additionalProperties": False}}}
# Another tool with a definition of the same name, and an older "definitions" section.
BILL = {"type": "function", "function": {"name": "bill", "parameters": {
    "type": "object", "definitions": {"address": {"type": "integer", "minimum": 0}},
    "properties": {"account": {"$ref": "#/definitions/address"},
                   "items": {"type": "array", "items": {"$ref": "#/properties/account"}}},
    "required": ["account"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters
TOOLS = [SHIP, BILL, PING]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 **fields)


def test_check_tools_fills_in_missing_parameters():
    checked = check_tools(request(tools=TOOLS).tools)
    assert checked[2] == {"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}}
    assert checked[0]["function"]["parameters"] == SHIP["function"]["parameters"]


def test_named_schema_accepts_the_call_and_nothing_else():
    schema = named_schema(check_tools(request(tools=TOOLS).tools)[0])
    validate(StructuredOutputsParams(json=schema))  # llguidance compiles it
    good = {"name": "ship", "arguments": {"to": {"street": "Main"}, "express": True}}
    jsonschema.validate(good, schema)
    for bad in ({"name": "bill", "arguments": good["arguments"]},
                {"name": "ship", "arguments": {"to": {}}},
                {"name": "ship", "arguments": {"to": {"street": "x"}, "extra": 1}},
                {"name": "ship"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_relocates_refs_without_collisions():
    tools = check_tools(request(tools=TOOLS).tools)
    schema = required_schema(tools, parallel=True)
    validate(StructuredOutputsParams(json=schema))
    assert set(schema["$defs"]) == {"ship__address", "bill__address"}
    calls = [{"name": "bill", "arguments": {"account": 3, "items": [1, 2]}},
             {"name": "ship", "arguments": {"to": {"street": "Main"}}},
             {"name": "ping", "arguments": {}}]
    jsonschema.validate(calls, schema)
    for bad in ([], [{"name": "bill", "arguments": {"account": -1}}],  # bill's own "address"
                [{"name": "bill", "arguments": {"account": 1, "items": ["x"]}}],
                [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls[:2], single)
    jsonschema.validate(calls[:1], single)


def test_plans():
    hermes = get_tool_parser("hermes")
    assert plan_tool_calls(request(), hermes, True).mode == "none"
    auto = plan_tool_calls(request(tools=TOOLS), hermes, True)
    assert (auto.mode, auto.parser_cls, auto.schema) == ("auto", hermes, None)
    none = plan_tool_calls(request(tools=TOOLS, tool_choice="none"), None, False)
    assert none.tools is not None and none.parser_cls is None
    required = plan_tool_calls(request(tools=TOOLS, tool_choice="required"), None, False)
    assert required.parser_cls is JsonToolCallsParser and required.schema["type"] == "array"
    named = plan_tool_calls(request(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "bill"}}), None, False)
    assert named.schema["properties"]["name"] == {"const": "bill"}


def test_constrain_sets_the_structured_output_and_keeps_special_tokens():
    plan = plan_tool_calls(request(tools=TOOLS, tool_choice="required"), None, False)
    params = plan.constrain(SamplingParams(max_tokens=8))
    json_schema = params.structured_outputs.json
    assert (json.loads(json_schema) if isinstance(json_schema, str) else json_schema) == plan.schema
    assert params.structured_outputs.disable_any_whitespace
    mistral = plan_tool_calls(request(tools=TOOLS), get_tool_parser("mistral"), True)
    params = mistral.constrain(SamplingParams(max_tokens=8))
    assert params.skip_special_tokens is False and mistral.strip_stop_token
    with pytest.raises(OpenAIError) as err:
        plan.constrain(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS}, "tool_choice"),  # "auto" on a server without a parser
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [PING, PING]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}]}, "tools[0].function.parameters"),
])
def test_errors_name_the_field(fields, param):
    with pytest.raises(OpenAIError) as err:
        plan_tool_calls(request(**fields), None, False)
    assert err.value.status_code == 400 and err.value.param == param
