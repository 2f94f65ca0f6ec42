"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from octavo.engine.async_llm import AsyncLLM, RequestOutputKind
from octavo.engine.core_client import EngineDeadError
from octavo.engine.processor import check_text
from octavo.entrypoints.openai.chat_output import (
    ChatOutputParser,
    delta_message,
    finish_reason,
    message_response,
    parse_message,
)
from octavo.entrypoints.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    check_template_kwargs,
    load_chat_template,
)
from octavo.entrypoints.openai.errors import OpenAIError, engine_dead_error
from octavo.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobToken,
    ChatMessage,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from octavo.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    SSEResponse,
    clamp_logprob,
    invalid_request,
    merge_streams,
    top_entries,
)
from octavo.entrypoints.openai.sse import ChatChunkEncoder
from octavo.entrypoints.openai.tool_calling import ToolCallPlan, plan_tool_calls
from octavo.entrypoints.openai.tool_parsers import get_tool_parser
from octavo.errors import InvalidRequestError
from octavo.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from octavo.reasoning import get_reasoning_parser

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 chat_template: str | None = None, tool_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, **kwargs: Any) -> None:
        super().__init__(engine, served_model_names, **kwargs)
        source = load_chat_template(chat_template, self.tokenizer)
        # None: the model has no template and none was given; chat requests get a 400.
        self.chat_template = ChatTemplate(source, self.tokenizer) if source is not None else None
        # Tool calls with tool_choice "auto" are read by this parser (--tool-call-parser).
        self.tool_parser_cls = get_tool_parser(tool_parser) if tool_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # Splits the model's thinking from its answer (--reasoning-parser).
        reasoning = engine.model_config.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(reasoning)(self.tokenizer) if reasoning else None
        if (enable_auto_tool_choice and self.chat_template is not None
                and not self.chat_template.renders_tools()):
            logger.warning("the chat template ignores 'tools': the model will not see the tools "
                           "requests define; give a template that renders them with "
                           "--chat-template")

    # ---- prompt ---------------------------------------------------------------------------

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (``tools`` and the request's
        ``chat_template_kwargs`` given to the template)."""
        if self.chat_template is None:
            raise OpenAIError(
                "this model has no chat template; start the server with --chat-template "
                "(a file or a jinja string), or use /v1/completions", 400, param="messages",
                code="no_chat_template",
            )
        if not messages:
            raise OpenAIError("messages must not be empty", 400, param="messages", code="invalid_value")
        conversation = [_entry_of(message, i) for i, message in enumerate(messages)]
        try:
            extra = check_template_kwargs(template_kwargs) if template_kwargs else None
        except ChatTemplateError as exc:
            raise OpenAIError(str(exc), 400, param="chat_template_kwargs",
                              code="invalid_value") from None
        try:
            text = self.chat_template.render(conversation, add_generation_prompt, tools, extra)
            check_text(text, "messages")
        except ChatTemplateError as exc:
            raise OpenAIError(str(exc), 400, param="messages", code="chat_template_error") from None
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        return text, list(self.tokenizer(text, add_special_tokens=False).input_ids)

    # ---- endpoint -------------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_fields(request)
        model, lora = self.resolve_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", 400, param="top_logprobs",
                              code="invalid_value")
        max_tokens, renamed = request.max_tokens, {"logprobs": "top_logprobs", "prompt": "messages"}
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            renamed["max_tokens"] = "max_completion_tokens"
        plan = plan_tool_calls(request, self.tool_parser_cls, self.enable_auto_tool_choice)
        text, token_ids = self.render(request.messages, request.add_generation_prompt, plan.tools,
                                      request.chat_template_kwargs)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = plan.constrain(self.sampling_params(request, max_tokens, logprobs,
                                                     params_renamed=renamed))
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        request_id = self.new_request_id()
        if request.stream:
            ids, streams = self.add_requests(request_id, [prompt], params, RequestOutputKind.DELTA,
                                             params_renamed=renamed, priority=request.priority,
                                         lora_request=lora)
            return SSEResponse(
                self._stream(request_id, model, request, len(token_ids), streams, plan, text),
                on_close=lambda: self.abort_all(ids),
            )
        ids, streams = self.add_requests(request_id, [prompt], params, RequestOutputKind.FINAL_ONLY,
                                         params_renamed=renamed, priority=request.priority,
                                         lora_request=lora)
        try:
            output = await self.wait_or_disconnect(raw_request, _final(streams[0]))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as exc:
            raise engine_dead_error(exc) from None
        except ValueError as exc:  # refused by the engine core
            raise OpenAIError(str(exc), 400, code="invalid_value") from None
        finally:
            self.abort_all(ids)
        choices = [self._choice(c, request, plan, text) for c in output.outputs]
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        response = ChatCompletionResponse(
            id=request_id, model=model, choices=choices,
            usage=UsageInfo(prompt_tokens=len(token_ids), completion_tokens=num_generated,
                            total_tokens=len(token_ids) + num_generated),
        )
        return JSONResponse(response.model_dump())

    def _choice(self, c: CompletionOutput, request: ChatCompletionRequest, plan: ToolCallPlan,
                prompt: str) -> ChatCompletionChoice:
        text = plan.answer_text(c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                self.tokenizer)
        message = parse_message(text, self.reasoning_parser, plan, prompt)
        return ChatCompletionChoice(
            index=c.index,
            message=message_response(message),
            logprobs=self._logprobs(c.token_ids, c.logprobs, request),
            finish_reason=finish_reason(c.finish_reason, bool(message.tool_calls)),
        )

    async def _stream(self, request_id: str, model: str, request: ChatCompletionRequest,
                      num_prompt_tokens: int, streams: list[AsyncIterator[RequestOutput]],
                      plan: ToolCallPlan, prompt: str) -> AsyncIterator[str]:
        created = int(time.time())
        # One parser per choice when the text is split (reasoning, tool calls); else plain text.
        parsers = None
        if self.reasoning_parser is not None or plan.parser_cls is not None:
            parsers = [ChatOutputParser(self.reasoning_parser, plan, prompt)
                       for _ in range(request.n)]
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=choices, usage=usage)
            return f"data: {body.model_dump_json(exclude=exclude)}\n\n"

        num_generated = 0
        # Events with text only (no logprobs, nothing to split out: the common case) skip
        # pydantic: see entrypoints.openai.sse.
        encoder = ChatChunkEncoder(request_id, created, model, include_usage)
        plain = parsers is None and not request.logprobs
        try:
            # The role comes first, once per choice.
            for index in range(request.n):
                yield encoder.role_chunk(index)
            async for _, output in merge_streams(streams):
                for c in output.outputs:
                    num_generated += len(c.token_ids)
                    if plain:
                        if c.text or c.finish_reason is not None:
                            yield encoder.content_chunk(c.index, c.text, c.finish_reason)
                        continue
                    logprobs = self._logprobs(c.token_ids, c.logprobs, request)
                    reason = c.finish_reason
                    if parsers is None:
                        delta = DeltaMessage(content=c.text) if c.text else DeltaMessage()
                    else:
                        parser = parsers[c.index]
                        text = plan.answer_text(c.text, c.token_ids, reason, c.stop_reason,
                                                self.tokenizer)
                        delta = delta_message(parser.feed(text, final=reason is not None))
                        reason = finish_reason(reason, parser.tools_called)
                    if delta == DeltaMessage() and reason is None and logprobs is None:
                        continue
                    yield chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=delta, logprobs=logprobs, finish_reason=reason)])
            if include_usage:
                yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens,
                                          completion_tokens=num_generated,
                                          total_tokens=num_prompt_tokens + num_generated))
        except EngineDeadError as exc:
            yield engine_dead_error(exc).to_sse()
        except ValueError as exc:
            yield OpenAIError(str(exc), 400, code="invalid_value").to_sse()
        yield "data: [DONE]\n\n"

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None,
                  request: ChatCompletionRequest) -> ChatChoiceLogprobs | None:
        if not request.logprobs or positions is None:
            return None
        num_top = request.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, positions):
            chosen = position[token_id]
            token = chosen.decoded_token if chosen.decoded_token is not None else self.token_text(token_id)
            content.append(ChatLogprobToken(
                token=token,
                logprob=clamp_logprob(chosen.logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=lp.decoded_token or "", logprob=clamp_logprob(lp.logprob),
                               bytes=list((lp.decoded_token or "").encode("utf-8")))
                    for _, lp in top_entries(position, num_top)
                ],
            ))
        return ChatChoiceLogprobs(content=content)


def _entry_of(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as the chat template gets it; tool calls' arguments as objects (what
    templates expect; the API sends them as JSON text)."""
    entry: dict[str, Any] = {
        # "developer" is OpenAI's newer name for "system"; templates know "system".
        "role": "system" if message.role == "developer" else message.role,
        "content": _text_of(message, index),
    }
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise OpenAIError("only assistant messages carry tool_calls", 400,
                              param=f"messages[{index}].tool_calls", code="invalid_value")
        calls = []
        for j, call in enumerate(message.tool_calls):
            where = f"messages[{index}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as exc:
                raise OpenAIError(f"{where} is not JSON: {exc}", 400, param=where,
                                  code="invalid_value") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        entry["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None:
            raise OpenAIError("a tool message needs tool_call_id, the id of the call it answers",
                              400, param=f"messages[{index}].tool_call_id", code="invalid_value")
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _text_of(message: ChatMessage, index: int) -> str:
    """A message's content as one string (text parts joined by newlines)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise OpenAIError(
                f"content part type {part.type!r} is not supported (only 'text' parts with a "
                "'text' field)", 400, param=f"messages[{index}].content[{j}]",
                code="unsupported_content",
            )
        texts.append(part.text)
    return "\n".join(texts)


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    assert final is not None, "a request ended without a final output"
    return final
