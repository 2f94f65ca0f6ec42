"""Tool calling on ``/v1/chat/completions``: the request's tools checked, ``tool_choice``
resolved into a ``ToolCallPlan``, and the JSON schema that enforces a forced choice.

- ``"none"``: tools reach the chat template, nothing is parsed.
- ``"auto"`` (the default when tools are given): the server's ``--tool-call-parser`` reads
  whatever calls the model wrote; needs ``--enable-auto-tool-choice`` (vLLM's rule, with
  vLLM's error message, which clients recognise).
- ``"required"`` / a named function: the answer is constrained by the structured-output
  engine (``SamplingParams.structured_outputs``) to JSON calls, read back by
  ``JsonToolCallsParser``. ``"required"``: an array of ``{"name", "arguments"}`` objects, one
  of the tools each (at most one item without ``parallel_tool_calls``); named: one such
  object, its name fixed. Arguments match the tool's ``parameters`` schema. No
  ``--tool-call-parser`` is needed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from octavo.entrypoints.openai.errors import OpenAIError
from octavo.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionToolsParam
from octavo.entrypoints.openai.tool_parsers import ToolParser
from octavo.entrypoints.openai.tool_parsers.forced import JsonToolCallsParser
from octavo.errors import InvalidRequestError
from octavo.sampling_params import (
    MAX_STRUCTURED_OUTPUT_CHARS,
    SamplingParams,
    StructuredOutputsParams,
)
from octavo.structured_output.grammar import validate as validate_structured_outputs

# Most tools one request may give (OpenAI's limit).
MAX_TOOLS = 128
# Longest JSON text of one tool's parameters schema: what the structured-output engine would
# accept. (A forced choice compiles every tool into one schema, whose size that engine's limit
# checks again; descriptions are bounded only by the body size and the context length.)
MAX_PARAMETERS_CHARS = MAX_STRUCTURED_OUTPUT_CHARS
# Deepest nesting of a parameters schema (deeper ones are refused before any recursion).
MAX_SCHEMA_DEPTH = 32
# OpenAI's function names (letters, digits, underscores, dashes; dots too), 1-64 characters.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# vLLM's wording, which clients match to detect a server without tool calling.
AUTO_TOOL_CHOICE_ERROR = ('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set")
# The schema of "no arguments".
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolCallPlan:
    """How one chat request uses tools."""

    # The tools as the chat template gets them (OpenAI's dicts); None when there are none.
    tools: list[dict[str, Any]] | None
    # "none", "auto", "required" or "named".
    mode: str
    # False: only the first call of an answer is kept.
    parallel: bool
    # Reads calls out of the answer: the server's parser ("auto"), the JSON one ("required",
    # named), or None (nothing is parsed).
    parser_cls: type[ToolParser] | None
    # "required"/named: the JSON schema the answer is constrained to.
    schema: dict[str, Any] | None = None
    # Special tokens are kept in the text only for the parser (``constrain`` turned
    # skip_special_tokens off): the text of the stop token that ends an answer (EOS) is then
    # not part of it (``answer_text``).
    strip_stop_token: bool = False

    def new_parser(self) -> ToolParser | None:
        return self.parser_cls() if self.parser_cls is not None else None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what the plan needs: the forced choice's structured output, and
        special tokens kept in the text when the parser's markers are special tokens."""
        changes: dict[str, Any] = {}
        if self.parser_cls is not None and self.parser_cls.keeps_special_tokens:
            changes["skip_special_tokens"] = False
            self.strip_stop_token = params.skip_special_tokens
        if self.schema is not None:
            if params.structured_outputs is not None:
                raise OpenAIError(
                    f"tool_choice {self.mode!r} constrains the answer to tool calls; it cannot be "
                    "combined with another output constraint (response_format, "
                    "structured_outputs)", 400, param="tool_choice", code="invalid_value")
            try:
                structured = StructuredOutputsParams(json=self.schema, disable_any_whitespace=True)
                validate_structured_outputs(structured)
            except InvalidRequestError as exc:
                raise OpenAIError(
                    f"the tools' parameters cannot be enforced for tool_choice {self.mode!r}: "
                    f"{exc.message}", 400, param="tools", code="invalid_value") from None
            changes["structured_outputs"] = structured
        return dataclasses.replace(params, **changes) if changes else params

    def answer_text(self, text: str, token_ids: list[int], finish_reason: str | None,
                    stop_reason: int | str | None, tokenizer: Any) -> str:
        """``text`` without the stop token's text at its end, when ``strip_stop_token`` and
        the completion (or this last piece of it) ended on a token (EOS or a stop token id)."""
        if (not self.strip_stop_token or finish_reason != "stop" or isinstance(stop_reason, str)
                or not token_ids):
            return text
        stop_text = tokenizer.decode([token_ids[-1]], skip_special_tokens=False)
        return text[:-len(stop_text)] if stop_text and text.endswith(stop_text) else text


def plan_tool_calls(request: ChatCompletionRequest, tool_parser_cls: type[ToolParser] | None,
                    enable_auto_tool_choice: bool) -> ToolCallPlan:
    """Check the request's tools and ``tool_choice``; 400 (``OpenAIError``) naming the field."""
    tools = check_tools(request.tools) if request.tools is not None else None
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise OpenAIError("tool_choice needs tools: give the functions the model may call in "
                          "'tools'", 400, param="tool_choice", code="invalid_value")
    parallel = request.parallel_tool_calls
    if choice == "none":
        return ToolCallPlan(tools, "none", parallel, None)
    assert tools is not None, "checked above"
    if choice == "auto":
        if not enable_auto_tool_choice or tool_parser_cls is None:
            raise OpenAIError(AUTO_TOOL_CHOICE_ERROR, 400, param="tool_choice",
                              code="invalid_value")
        return ToolCallPlan(tools, "auto", parallel, tool_parser_cls)
    if choice == "required":
        return ToolCallPlan(tools, "required", parallel, JsonToolCallsParser,
                            schema=required_schema(tools, parallel))
    name = choice.function.name
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise OpenAIError(
            f"tool_choice names the function {name!r}, which is not in tools (they are: "
            f"{', '.join(t['function']['name'] for t in tools)})", 400,
            param="tool_choice.function.name", code="invalid_value")
    return ToolCallPlan(tools, "named", parallel, JsonToolCallsParser, schema=named_schema(tool))


def check_tools(tools: list[ChatCompletionToolsParam]) -> list[dict[str, Any]]:
    """The tools as plain dicts (missing ``parameters``: no arguments), each checked: a valid,
    unique name and a parameters object schema; 400 naming the first bad one."""
    if not tools:
        raise OpenAIError("tools must not be empty: give at least one tool or leave the field "
                          "out", 400, param="tools", code="invalid_value")
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}", 400,
                          param="tools", code="too_many")
    checked: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        where = f"tools[{i}].function"
        if not _FUNCTION_NAME.fullmatch(function.name):
            raise OpenAIError(
                f"{where}.name {function.name!r} is not a valid function name: use 1 to 64 "
                "letters, digits, underscores, dashes or dots", 400, param=f"{where}.name",
                code="invalid_value")
        if function.name in seen:
            raise OpenAIError(f"{where}.name: two tools are named {function.name!r}; names must "
                              "be unique", 400, param=f"{where}.name", code="invalid_value")
        seen.add(function.name)
        parameters = function.parameters if function.parameters is not None else _NO_PARAMETERS
        _check_parameters(parameters, f"{where}.parameters")
        size = len(json.dumps(parameters))
        if size > MAX_PARAMETERS_CHARS:
            raise OpenAIError(f"{where}.parameters is {size} characters of JSON; at most "
                              f"{MAX_PARAMETERS_CHARS} are accepted", 400,
                              param=f"{where}.parameters", code="invalid_value")
        entry: dict[str, Any] = {"name": function.name, "parameters": parameters}
        if function.description is not None:
            entry["description"] = function.description
        if function.strict is not None:
            entry["strict"] = function.strict
        checked.append({"type": "function", "function": entry})
    return checked


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise OpenAIError(f"{param} is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are "
                          "accepted", 400, param=param, code="invalid_value")
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise OpenAIError(f"{param} must be a JSON schema of type 'object' (the arguments are a "
                          f"JSON object), got type {kind!r}", 400, param=param,
                          code="invalid_value")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise OpenAIError(f"{param} is not a valid JSON schema: {exc.message}"
                          f"{f' (at {where[1:]})' if where else ''}", 400, param=param,
                          code="invalid_value") from None


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


# ---- the JSON schema of a forced choice ---------------------------------------------------------


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """One call object of ``tool``: ``{"name": <its name>, "arguments": <its parameters>}``."""
    defs: dict[str, Any] = {}
    schema = _call_schema(tool, "/properties/arguments", defs)
    if defs:
        schema["$defs"] = defs
    return schema


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """An array of call objects, each one of ``tools`` (at most one item unless ``parallel``)."""
    defs: dict[str, Any] = {}
    items = [_call_schema(tool, f"/items/anyOf/{i}/properties/arguments", defs)
             for i, tool in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call_schema(tool: dict[str, Any], location: str, defs: dict[str, Any]) -> dict[str, Any]:
    """The call object's schema; the parameters' local ``$ref``s are rewritten for their new
    ``location`` (a JSON pointer), their ``$defs``/``definitions`` moved into ``defs`` under
    names prefixed by the function's (so that two tools' definitions never collide)."""
    function = tool["function"]
    name = function["name"]
    parameters = json.loads(json.dumps(function["parameters"]))  # a copy to rewrite
    for key in ("$defs", "definitions"):
        for def_name, definition in (parameters.pop(key, None) or {}).items():
            defs[f"{name}__{def_name}"] = _relocate(definition, name, location)
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _relocate(parameters, name, location)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _relocate(schema: Any, function: str, location: str) -> Any:
    """``schema`` with every local ``$ref`` pointing where its target now lives."""
    if isinstance(schema, list):
        return [_relocate(item, function, location) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = _relocate_ref(value, function, location)
        else:
            out[key] = _relocate(value, function, location)
    return out


def _relocate_ref(ref: str, function: str, location: str) -> str:
    pointer = ref[1:]
    for key in ("$defs", "definitions"):
        prefix = f"/{key}/"
        if pointer.startswith(prefix):  # function names need no JSON-pointer escaping
            return f"#/$defs/{function}__{pointer[len(prefix):]}"
    return f"#{location}{pointer}"
