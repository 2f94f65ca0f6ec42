"""``POST /v1/completions``: prompts as text or token ids, batched, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from octavo.engine.async_llm import RequestOutputKind
from octavo.engine.core_client import EngineDeadError
from octavo.entrypoints.openai.errors import OpenAIError, engine_dead_error
from octavo.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptLogprob,
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
from octavo.entrypoints.openai.sse import CompletionChunkEncoder
from octavo.errors import InvalidRequestError
from octavo.outputs import PositionLogprobs, RequestOutput
from octavo.sampling_params import BeamSearchParams, SamplingParams


class _Prompt:
    """One prompt of the request: its text (for echo) and token ids."""

    __slots__ = ("text", "token_ids")

    def __init__(self, text: str, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_fields(request)
        model, lora = self.resolve_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", 400, param="suffix", code="unsupported_field")
        prompts = self._prompts(request.prompt)
        self.check_batch(len(prompts), max(request.n, request.best_of or 0))
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        params: SamplingParams | BeamSearchParams
        if request.use_beam_search:
            params = self._beam_search_params(request)
        else:
            params = self.sampling_params(request, request.max_tokens, request.logprobs,
                                          prompt_logprobs, best_of=request.best_of)
        engine_prompts = [{"prompt": p.text, "prompt_token_ids": p.token_ids} for p in prompts]
        request_id = self.new_request_id()
        if request.stream:
            ids, streams = self.add_requests(request_id, engine_prompts, params,
                                             RequestOutputKind.DELTA, priority=request.priority,
                                             lora_request=lora)
            return SSEResponse(
                self._stream(request_id, model, request, prompts, streams),
                on_close=lambda: self.abort_all(ids),
            )
        ids, streams = self.add_requests(request_id, engine_prompts, params,
                                         RequestOutputKind.FINAL_ONLY, priority=request.priority,
                                         lora_request=lora)
        try:
            outputs = await self.wait_or_disconnect(raw_request, _collect(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as exc:
            raise engine_dead_error(exc) from None
        except ValueError as exc:  # refused by the engine core
            raise OpenAIError(str(exc), 400, code="invalid_value") from None
        finally:
            self.abort_all(ids)
        return JSONResponse(self._response(request_id, model, request, prompts, outputs).model_dump())

    def _beam_search_params(self, request: CompletionRequest) -> BeamSearchParams:
        """``use_beam_search``: ``n`` beams; the fields beam search has no use for are refused."""
        for name in ("logprobs", "prompt_logprobs", "best_of", "seed", "top_p", "top_k",
                     "min_p", "logit_bias", "stop", "structured_outputs", "response_format",
                     "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "bad_words", "allowed_token_ids", "logits_processors"):
            if getattr(request, name) not in (None, []):
                raise OpenAIError(f"{name} cannot be used with use_beam_search", 400,
                                  param=name, code="unsupported_value")
        if request.stream:
            raise OpenAIError("use_beam_search does not stream: its sequences are chosen at the "
                              "end; send stream=false", 400, param="stream",
                              code="unsupported_value")
        if request.max_tokens is None:
            raise OpenAIError("use_beam_search needs max_tokens", 400, param="max_tokens",
                              code="invalid_value")
        try:
            return BeamSearchParams(
                beam_width=request.n, max_tokens=request.max_tokens,
                ignore_eos=request.ignore_eos, temperature=request.temperature or 0.0,
                length_penalty=request.length_penalty,
                include_stop_str_in_output=request.include_stop_str_in_output)
        except InvalidRequestError as exc:
            raise invalid_request(exc, {"beam_width": "n"}) from None

    def _prompts(self, prompt: Any) -> list[_Prompt]:
        """Normalise the four prompt forms to (text, token ids), checked by the engine's
        validator (the text needs the ids' validity first, for echo)."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        else:
            items = list(prompt)
            if not items:
                raise OpenAIError("prompt must not be empty", 400, param="prompt", code="empty_prompt")
            if all(isinstance(x, int) for x in items):
                items = [items]  # one prompt of token ids
        prompts = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            try:
                text, token_ids = self.engine.processor.tokenize(item)
            except InvalidRequestError as exc:
                raise invalid_request(exc, {"prompt": param}) from None
            prompts.append(_Prompt(text if text is not None else self.tokenizer.decode(token_ids),
                                   token_ids))
        return prompts

    def _response(self, request_id: str, model: str, request: CompletionRequest,
                  prompts: list[_Prompt], outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        num_generated = 0
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                text = completion.text
                token_ids = list(completion.token_ids)
                positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
                offset = len(prompt.text)
                if request.echo:
                    text = prompt.text + text
                    token_ids = prompt.token_ids + token_ids
                    positions = list(output.prompt_logprobs or [None] * len(prompt.token_ids)) + positions
                    offset = 0
                choices.append(CompletionChoice(
                    index=i * request.n + completion.index,
                    text=text,
                    logprobs=self._logprobs(token_ids, positions, request.logprobs, offset),
                    finish_reason=completion.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(request, output.prompt_logprobs),
                ))
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(
            id=request_id, model=model, choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                            total_tokens=num_prompt + num_generated),
        )

    async def _stream(self, request_id: str, model: str, request: CompletionRequest,
                      prompts: list[_Prompt], streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        exclude = None if include_usage else {"usage"}
        n = request.n
        echoed = [False] * (len(prompts) * n)
        started = [False] * (len(prompts) * n)
        offsets = [0 if request.echo else len(p.text) for p in prompts for _ in range(n)]
        prompt_logprobs: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        num_generated = 0
        encoder = CompletionChunkEncoder(request_id, created, model, include_usage)
        # Events with text only (the common case) skip pydantic: see entrypoints.openai.sse.
        plain = request.logprobs is None and request.prompt_logprobs is None
        try:
            async for i, output in merge_streams(streams):
                prompt = prompts[i]
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                for completion in output.outputs:
                    index = i * n + completion.index
                    num_generated += len(completion.token_ids)
                    text = completion.text
                    if plain:
                        if request.echo and not echoed[index]:
                            echoed[index] = True
                            text = prompt.text + text
                        yield encoder.text_chunk(index, text, completion.finish_reason)
                        continue
                    token_ids = list(completion.token_ids)
                    positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
                    if request.echo and not echoed[index]:
                        echoed[index] = True
                        text = prompt.text + text
                        token_ids = prompt.token_ids + token_ids
                        positions = list(prompt_logprobs[i] or [None] * len(prompt.token_ids)) + positions
                    logprobs = self._logprobs(token_ids, positions, request.logprobs, offsets[index])
                    if logprobs is not None:
                        offsets[index] += sum(len(t) for t in logprobs.tokens)
                    first = not started[index]
                    started[index] = True
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            prompt_logprobs=(self._prompt_logprobs(request, prompt_logprobs[i])
                                             if first else None),
                        )],
                    )
                    yield f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
            if include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                    total_tokens=num_prompt + num_generated),
                )
                yield f"data: {chunk.model_dump_json()}\n\n"
        except EngineDeadError as exc:
            yield engine_dead_error(exc).to_sse()
        except ValueError as exc:
            yield OpenAIError(str(exc), 400, code="invalid_value").to_sse()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _prompt_logprobs(
        request: CompletionRequest, positions: list[PositionLogprobs | None] | None
    ) -> list[dict[int, PromptLogprob] | None] | None:
        """``choices[i].prompt_logprobs`` when the request asked for them (vLLM's field)."""
        if request.prompt_logprobs is None or positions is None:
            return None
        return [
            None if position is None else {
                token_id: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                        decoded_token=lp.decoded_token)
                for token_id, lp in position.items()
            }
            for position in positions
        ]

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                  num_top: int | None, offset: int) -> CompletionLogprobs | None:
        """The legacy completions logprobs object (None unless logprobs were asked for)."""
        if num_top is None:
            return None
        result = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions):
            if position is None:  # the first prompt token has no logprob
                token = self.token_text(token_id)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = position[token_id]
                token = chosen.decoded_token if chosen.decoded_token is not None else self.token_text(token_id)
                result.token_logprobs.append(clamp_logprob(chosen.logprob))
                top = {
                    (lp.decoded_token or ""): clamp_logprob(lp.logprob)
                    for _, lp in top_entries(position, num_top)
                }
                top.setdefault(token, clamp_logprob(chosen.logprob))
                result.top_logprobs.append(top)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of each stream (FINAL_ONLY streams yield just that one)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merge_streams(streams):
        finals[i] = output
    assert all(f is not None for f in finals), "a request ended without a final output"
    return finals  # type: ignore[return-value]
