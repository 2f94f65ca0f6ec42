"""What the completion and chat endpoints share: checks, sampling params, running requests.

Every check that protects the engine happens here, before anything is queued: unsupported
fields, the model name, token ids in the vocabulary, prompt + max_tokens within
max_model_len, logprob counts, the waiting-queue cap. ``SamplingParams`` and the engine's own
``Processor`` then check values (a ``ValueError`` naming the field becomes a 400).
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from octavo.engine.async_llm import AsyncLLM, RequestOutputKind
from octavo.engine.core_client import EngineDeadError
from octavo.entrypoints.openai.errors import OpenAIError, engine_dead_error
from octavo.entrypoints.openai.protocol import SamplingFields, unsupported_fields
from octavo.outputs import PositionLogprobs, RequestOutput
from octavo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Logprobs of -inf cannot be written as JSON.
_MIN_LOGPROB = -9999.0


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its requests are aborted)."""


class OpenAIServing:
    """Base of ``OpenAIServingCompletion`` and ``OpenAIServingChat``."""

    # Prefix of response ids ("cmpl", "chatcmpl").
    id_prefix = "req"

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        max_waiting_requests: int | None = None,
        max_logprobs: int = 20,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_waiting_requests = max_waiting_requests
        self.max_logprobs = max_logprobs
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size

    # ---- checks ---------------------------------------------------------------------------

    def check_fields(self, request: Any) -> None:
        """400 naming every field given that this server does not support."""
        extra = unsupported_fields(request)
        if extra:
            raise OpenAIError(
                f"unsupported field{'s' if len(extra) > 1 else ''}: {', '.join(extra)}",
                400, param=extra[0], code="unsupported_field",
            )

    def check_model(self, model: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(
                f"the model {model!r} does not exist; this server serves {self.served_model_names}",
                404, param="model", code="model_not_found",
            )
        return model

    def check_admission(self) -> None:
        """503 when the engine is dead or too many requests are already waiting."""
        if self.engine.is_dead:
            raise engine_dead_error(EngineDeadError(self.engine.dead_reason))
        cap = self.max_waiting_requests
        if cap is not None and self.engine.num_waiting_requests >= cap:
            raise OpenAIError(
                f"the server is overloaded: {self.engine.num_waiting_requests} requests are "
                f"waiting (limit {cap}); retry later", 503, code="overloaded",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise OpenAIError("the prompt is empty: give at least one token", 400, param=param,
                              code="empty_prompt")
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise OpenAIError(
                    f"token id {token_id} in {param} is out of the vocabulary [0, {self.vocab_size})",
                    400, param=param, code="invalid_value",
                )

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """400 when the prompt plus max_tokens would not fit max_model_len."""
        if num_prompt_tokens == 0:
            raise OpenAIError("the prompt is empty: give at least one token", 400, param="prompt",
                              code="empty_prompt")
        wanted = num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
        if wanted > self.max_model_len:
            detail = (f"{num_prompt_tokens} in the prompt + {max_tokens} for the completion"
                      if max_tokens is not None else f"{num_prompt_tokens} in the prompt + 1")
            raise OpenAIError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{wanted} were requested ({detail}); shorten the prompt or lower {param}",
                400, param=param if max_tokens is not None else "prompt",
                code="context_length_exceeded",
            )

    def check_num_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise OpenAIError(f"{param} must be in [0, {self.max_logprobs}], got {value}", 400,
                              param=param, code="invalid_value")

    # ---- sampling params ------------------------------------------------------------------

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` from the request's fields (OpenAI defaults where unset)."""
        kwargs: dict[str, Any] = {
            "n": request.n,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "ignore_eos": request.ignore_eos,
            "min_tokens": request.min_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
            "skip_special_tokens": request.skip_special_tokens,
            "seed": request.seed,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        if request.logit_bias is not None:
            bias = {}
            for key, value in request.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise OpenAIError(f"logit_bias keys must be token ids, got {key!r}", 400,
                                      param="logit_bias", code="invalid_value") from None
            kwargs["logit_bias"] = bias
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options is only allowed with stream=true", 400,
                              param="stream_options", code="invalid_value")
        try:
            params = SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise OpenAIError(str(exc), 400, param=_field_named(str(exc)), code="invalid_value") from None
        if params.max_token_id >= self.vocab_size:
            raise OpenAIError(
                f"token id {params.max_token_id} in stop_token_ids/logit_bias is out of the "
                f"vocabulary [0, {self.vocab_size})", 400,
                param="stop_token_ids" if params.max_token_id in params.stop_token_ids else "logit_bias",
                code="invalid_value",
            )
        return params

    # ---- running requests -----------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def add_requests(
        self,
        request_id: str,
        prompts: list[dict[str, Any]],
        params: SamplingParams,
        output_kind: RequestOutputKind,
    ) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Queue one engine request per prompt, all or none; return their ids and output streams.

        The caller must ``abort_all(ids)`` when done (a no-op for finished requests): a stream
        that is never iterated cannot abort its request by itself.
        """
        self.check_admission()
        added: list[tuple[str, asyncio.Queue[Any]]] = []
        try:
            for i, prompt in enumerate(prompts):
                sub_id = f"{request_id}-{i}"
                added.append((sub_id, self.engine.add_request(sub_id, prompt, params, output_kind)))
        except BaseException as exc:
            for sub_id, _ in added:
                self.engine.abort(sub_id)
            if isinstance(exc, EngineDeadError):
                raise engine_dead_error(exc) from None
            if isinstance(exc, (ValueError, TypeError)):
                raise OpenAIError(str(exc), 400, param=_field_named(str(exc)), code="invalid_value") from None
            raise
        ids = [sub_id for sub_id, _ in added]
        return ids, [self.engine.iterate_outputs(sub_id, queue) for sub_id, queue in added]

    def abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)

    async def wait_or_disconnect(self, raw_request: Request, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` unless the client disconnects first (then cancel it)."""
        work = asyncio.ensure_future(awaitable)
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise ClientDisconnected()
        return work.result()

    # ---- logprobs -------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as ``(iterator index, item)``, as they come.

    Leaving early (or an error in one) cancels every iterator, which aborts its request.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def drain(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, done))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def top_entries(position: PositionLogprobs, num: int) -> list[tuple[int, Any]]:
    """The ``num`` most likely (token id, Logprob) of a position, most likely first."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num]
    ranked.sort(key=lambda item: item[1].rank)
    return ranked[:num]


def _field_named(message: str) -> str | None:
    """The field an engine error message starts with (``"top_p must be ..."`` -> ``top_p``)."""
    first = message.split(" ", 1)[0].split("[", 1)[0]
    return first if first.isidentifier() and first not in {"the", "a", "token", "prompt"} else None


class SSEResponse(StreamingResponse):
    """A server-sent-events stream that runs ``on_close`` however it ends (client gone too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
