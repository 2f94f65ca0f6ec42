"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests accept extra fields at parse time and ``unsupported_fields`` lists them afterwards, so
the server can answer 400 *naming* every field it does not support (OpenAI fields such as
``suffix`` or ``functions`` as much as typos) instead of silently ignoring them.

Request fields are validated strictly: no coercion of booleans to integers (``[true, false]``
is not a list of token ids) or of strings to numbers (``"0.5"`` is not a temperature); JSON
integers are accepted where numbers are expected.
"""

from __future__ import annotations

import functools
import time
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class OpenAIRequest(BaseModel):
    """Base of request bodies: extra fields are kept so they can be reported; types strict."""

    model_config = ConfigDict(extra="allow", strict=True)


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _can_hold_a_model(annotation: Any) -> bool:
    """Whether a field of this type can hold a pydantic model (in a list or union too)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_can_hold_a_model(arg) for arg in typing.get_args(annotation))


@functools.cache
def _model_field_names(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``cls`` that can hold nested models: the only ones worth walking (a
    prompt of token ids is a list of thousands of ints)."""
    return tuple(name for name, info in cls.model_fields.items()
                 if _can_hold_a_model(info.annotation))


def unsupported_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of every field given but not modelled, nested models and lists included."""
    names = [f"{prefix}{key}" for key in (model.model_extra or {})]
    for name in _model_field_names(type(model)):
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                names.extend(unsupported_fields(item, where))
    return names


# ---- shared pieces ----------------------------------------------------------------------------


class StreamOptions(OpenAIRequest):
    # Send a last chunk with the usage of the whole request (and "usage": null before).
    include_usage: bool = False


class JsonSchemaFormat(OpenAIRequest):
    # OpenAI requires a name; it only labels the schema here.
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # Accepted for compatibility: the schema is always enforced exactly.
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    # "text": no constraint; "json_object": any JSON object; "json_schema": json_schema.schema.
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIRequest):
    """vLLM's ``structured_outputs`` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    # EBNF: GBNF (llama.cpp's dialect) or Lark.
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(OpenAIRequest):
    """Sampling fields shared by completions and chat (those of ``octavo.SamplingParams``)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Token id (as a string, like OpenAI) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Constrained output: OpenAI's response_format, or vLLM's structured_outputs (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older names of the structured_outputs fields (still in many clients' scripts).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's sampling extensions (see octavo.SamplingParams).
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # Logits processors registered by plugins: names, or {"qualname": NAME, "kwargs": {...}}.
    logits_processors: list[str | dict[str, Any]] | None = None
    # Scheduling priority, lower first (only with --scheduling-policy priority).
    priority: int = 0
    # Accepted for compatibility; not used.
    user: str | None = None


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# ---- /v1/completions --------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids or a list of lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    # Top logprobs per token (0: only the chosen token's).
    logprobs: int | None = None
    # Top logprobs per prompt token (vLLM's extension): returned in choices[i].prompt_logprobs;
    # echo + logprobs also asks for them, for the echoed prompt's logprobs.
    prompt_logprobs: int | None = None
    # Sample best_of completions and return the n with the highest cumulative logprob.
    best_of: int | None = None
    # vLLM's beam search: n beams (beam_width), scored cumulative logprob / length **
    # length_penalty; deterministic (temperature 0 or unset).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Not supported (rejected when set).
    suffix: str | None = None


class CompletionLogprobs(OpenAIResponse):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIResponse):
    """One token's entry in ``prompt_logprobs`` (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # With the request's prompt_logprobs: per prompt token, token id -> its logprob entry (the
    # actual token and the top ones); None for the first token. Streamed with a choice's
    # first chunk.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk of a streamed completion (same shape as the full response)."""


# ---- /v1/chat/completions ---------------------------------------------------------------------


class ContentPart(OpenAIRequest):
    # Only "text" parts are supported; other types get a 400 naming them.
    type: str
    text: str | None = None


class FunctionCall(OpenAIRequest):
    name: str
    # The arguments' JSON text (an object).
    arguments: str


class ToolCallParam(OpenAIRequest):
    """A call an assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Assistant messages: the calls they made.
    tool_calls: list[ToolCallParam] | None = None
    # Tool messages: the call they answer.
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIRequest):
    name: str
    description: str | None = None
    # JSON schema of the arguments (an object schema); absent: no arguments.
    parameters: dict[str, Any] | None = None
    # Accepted; the schema is enforced with tool_choice "required" or a named function.
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # End the rendered prompt with the assistant turn's opening (octavo extension).
    add_generation_prompt: bool = True
    # Functions the model may call; given to the chat template.
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none".
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    # False: at most one call per answer.
    parallel_tool_calls: bool = True
    # Extra variables for the chat template (Qwen3's enable_thinking, for instance).
    chat_template_kwargs: dict[str, Any] | None = None


class FunctionCallResponse(OpenAIResponse):
    name: str
    arguments: str


class ToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallResponse


class ChatMessageResponse(OpenAIResponse):
    role: Literal["assistant"] = "assistant"
    # None when the answer is only tool calls.
    content: str | None
    # The model's thinking, with --reasoning-parser (omitted when there is none).
    reasoning_content: str | None = None
    # Omitted when there are none.
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class TopLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIResponse):
    content: list[ChatLogprobToken] | None = None


class ChatCompletionChoice(OpenAIResponse):
    index: int
    message: ChatMessageResponse
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIResponse):
    # In a call's first delta only.
    name: str | None = None
    # The next fragment of the arguments' JSON text.
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(OpenAIResponse):
    index: int
    # id and type: in a call's first delta only.
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaMessage(OpenAIResponse):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer, errors ----------------------------------------------------------------


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "octavo"
    # The model folder or file the name serves (a LoRA adapter's folder).
    root: str
    # For a LoRA adapter: the base model it runs on (None for the base model).
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIRequest):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIRequest):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and
    ignored: the name identifies the adapter)."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    # Either a prompt...
    prompt: str | None = None
    add_special_tokens: bool = True
    # ...or chat messages, rendered with the chat template first.
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # With messages: the tools given to the chat template, and extra template variables.
    tools: list[ChatCompletionToolsParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIResponse):
    prompt: str


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIResponse):
    error: ErrorInfo
