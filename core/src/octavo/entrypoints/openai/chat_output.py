"""One chat choice's generated text split into reasoning, content and tool calls.

The reasoning parser (``--reasoning-parser``) runs first; the tool-call parser of the request's
``ToolCallPlan`` reads only the answer part. ``ChatOutputParser`` does it piece by piece for a
stream and ``parse_message`` for a whole text, through the same parsers; when
``parallel_tool_calls`` is false only the first call is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.entrypoints.openai.protocol import (
    ChatMessageResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallResponse,
)
from octavo.entrypoints.openai.protocol import ToolCall as ToolCallResponse
from octavo.entrypoints.openai.tool_calling import ToolCallPlan
from octavo.entrypoints.openai.tool_parsers import ToolCall, ToolCallDelta, ToolParser
from octavo.reasoning import ReasoningParser, ReasoningStream


@dataclass(slots=True)
class ChoiceDelta:
    """What one piece of a choice's text adds to its message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ParsedMessage:
    """A whole choice's message."""

    # The thinking (None: none, or no reasoning parser).
    reasoning: str | None
    # The answer's text (None when the answer is only tool calls, or reasoning never ended).
    content: str | None
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """Splits one streamed choice; ``tools_called`` once a call has been given out."""

    def __init__(self, reasoning_parser: ReasoningParser | None, plan: ToolCallPlan | None,
                 prompt: str) -> None:
        self._reasoning: ReasoningStream | None = (
            reasoning_parser.stream(prompt) if reasoning_parser is not None else None)
        self._tools: ToolParser | None = plan.new_parser() if plan is not None else None
        self._parallel = plan.parallel if plan is not None else True
        self.tools_called = False

    def feed(self, text: str, final: bool = False) -> ChoiceDelta:
        """What ``text`` adds; ``final``: the choice ends with it (flush what was held)."""
        out = ChoiceDelta()
        answer = text
        if self._reasoning is not None:
            step = self._reasoning.feed(text)
            if final:
                rest = self._reasoning.finish()
                step.reasoning += rest.reasoning
                step.content += rest.content
            out.reasoning, answer = step.reasoning, step.content
        if self._tools is None:
            out.content = answer
            return out
        found = self._tools.feed(answer)
        if final:
            found += self._tools.finish()
        out.content = found.content
        out.tool_calls = [d for d in found.tool_calls if self._parallel or d.index == 0]
        self.tools_called = self.tools_called or bool(out.tool_calls)
        return out


def parse_message(text: str, reasoning_parser: ReasoningParser | None, plan: ToolCallPlan | None,
                  prompt: str) -> ParsedMessage:
    """The message of a whole choice (the same split as streaming, all at once)."""
    reasoning, answer = None, text
    if reasoning_parser is not None:
        reasoning, answer = reasoning_parser.split(text, prompt)
    if plan is None or plan.parser_cls is None or answer is None:
        return ParsedMessage(reasoning, answer, [])
    extracted = plan.parser_cls.extract(answer)
    calls = extracted.tool_calls if plan.parallel else extracted.tool_calls[:1]
    return ParsedMessage(reasoning, extracted.content, calls)


# ---- into the response's shapes ----------------------------------------------------------------


def delta_message(delta: ChoiceDelta) -> DeltaMessage:
    """The ``delta`` of a streamed chunk (empty parts left out)."""
    return DeltaMessage(
        content=delta.content or None,
        reasoning_content=delta.reasoning or None,
        tool_calls=[
            DeltaToolCall(index=d.index, id=d.id, type="function" if d.id is not None else None,
                          function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
            for d in delta.tool_calls
        ] or None,
    )


def message_response(message: ParsedMessage) -> ChatMessageResponse:
    return ChatMessageResponse(
        content=message.content,
        reasoning_content=message.reasoning,
        tool_calls=[ToolCallResponse(id=c.id, function=FunctionCallResponse(name=c.name,
                                                                             arguments=c.arguments))
                    for c in message.tool_calls],
    )


def finish_reason(reason: str | None, tools_called: bool) -> str | None:
    """OpenAI's ``"tool_calls"`` for an answer that stopped after calling tools."""
    return "tool_calls" if tools_called and reason == "stop" else reason
