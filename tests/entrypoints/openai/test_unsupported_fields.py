"""``unsupported_fields``: every extra field named, nested ones too, without walking fields that
cannot hold a model (a prompt of token ids)."""

from __future__ import annotations

from octavo.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _model_field_names,
    unsupported_fields,
)


def test_nested_extras_are_named_with_their_path() -> None:
    request = ChatCompletionRequest.model_validate({
        "model": "m", "top_level_extra": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}],
        "tools": [{"type": "function", "function": {"name": "f", "zz": 2}}],
        "stream_options": {"include_usage": True, "extra_option": 3},
    })
    assert unsupported_fields(request) == [
        "top_level_extra", "stream_options.extra_option", "messages[0].content[0].bogus",
        "tools[0].function.zz"]


def test_only_fields_that_can_hold_a_model_are_walked() -> None:
    walked = _model_field_names(CompletionRequest)
    assert "prompt" not in walked and "logit_bias" not in walked
    assert {"stream_options", "response_format", "structured_outputs"} <= set(walked)
    assert {"messages", "tools", "tool_choice"} <= set(_model_field_names(ChatCompletionRequest))
    request = CompletionRequest.model_validate({"model": "m", "prompt": list(range(5000))})
    assert unsupported_fields(request) == []
