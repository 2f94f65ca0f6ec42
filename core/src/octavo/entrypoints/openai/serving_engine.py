"""What the completion and chat endpoints share: HTTP-level checks, sampling params, running
requests.

Only what is about HTTP and the OpenAI schema is checked here: unsupported fields, the model
name, the waiting-queue cap, field combinations the schema forbids. Everything about the
request's content (token ids, lengths, logprob counts, sampling ranges, the KV cache, the
backend) is checked by the engine's one validator (``octavo.engine.processor.Processor``, and
``SamplingParams`` itself), whose ``InvalidRequestError`` carries the field and a code: it
becomes a 400 here, its ``param`` translated to the field name the client used.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from octavo.engine.async_llm import AsyncLLM, RequestOutputKind
from octavo.engine.core_client import EngineDeadError
from octavo.engine.output_collector import RequestOutputCollector
from octavo.entrypoints.openai.errors import OpenAIError, engine_dead_error
from octavo.entrypoints.openai.protocol import SamplingFields, unsupported_fields
from octavo.entrypoints.openai.serving_models import ServingModels
from octavo.errors import InvalidRequestError
from octavo.lora_request import LoRARequest
from octavo.outputs import PositionLogprobs, RequestOutput
from octavo.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from octavo.structured_output.grammar import validate as validate_structured_outputs

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
        models: ServingModels | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        # The names requests may give as "model": the base model's and its LoRA adapters'.
        self.models = models if models is not None else ServingModels(served_model_names)
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len

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
        return self.models.resolve(model)[0]

    def resolve_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(served name to answer with, the LoRA adapter it names or None); 404 for a model
        this server does not serve."""
        return self.models.resolve(model)

    def check_batch(self, num_prompts: int, n: int) -> None:
        """400 when one HTTP request asks for more completions (prompts x n) than ``max_n``."""
        limit = self.engine.model_config.max_n
        if num_prompts * n > limit:
            raise OpenAIError(
                f"this request asks for {num_prompts * n} completions ({num_prompts} prompts x n="
                f"{n}); at most {limit} (max_n) are allowed per request", 400,
                param="prompt" if num_prompts > 1 else "n", code="too_many",
            )

    def check_admission(self, num_new: int) -> None:
        """503 when the engine is dead, or when ``--max-waiting-requests`` completions already
        wait or ``num_new`` more would make more wait (a request larger than the cap is still
        admitted into an empty queue: ``max_n`` bounds it)."""
        if self.engine.is_dead:
            raise engine_dead_error(EngineDeadError(self.engine.dead_reason))
        cap = self.max_waiting_requests
        waiting = self.engine.num_waiting_requests
        if cap is not None and (waiting >= cap or (waiting > 0 and waiting + num_new > cap)):
            raise OpenAIError(
                f"the server is overloaded: {waiting} requests are waiting and this one would "
                f"add {num_new} (limit {cap}); retry later", 503, code="overloaded",
            )

    # ---- sampling params ------------------------------------------------------------------

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        params_renamed: dict[str, str] | None = None,
        best_of: int | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` from the request's fields; a sampling field the request leaves
        unset takes the model's default (its generation_config.json, ``--generation-config``),
        else OpenAI's.

        :param params_renamed: engine field -> the request's field, for error messages.
        """
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
            "bad_words": request.bad_words,
            "allowed_token_ids": request.allowed_token_ids,
            "truncate_prompt_tokens": request.truncate_prompt_tokens,
            "logits_processors": request.logits_processors,
            "best_of": best_of,
        }
        kwargs.update(self.engine.model_config.sampling_defaults)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        if request.logit_bias is not None:
            kwargs["logit_bias"] = dict(request.logit_bias)  # "token id" strings: checked there
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options is only allowed with stream=true", 400,
                              param="stream_options", code="invalid_value")
        renamed = dict(params_renamed or {})
        try:
            structured = structured_outputs_params(request, renamed)
            if structured is not None:
                validate_structured_outputs(structured)
                kwargs["structured_outputs"] = structured
            return SamplingParams(**kwargs)
        except InvalidRequestError as exc:
            raise invalid_request(exc, renamed) from None

    # ---- running requests -----------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def add_requests(
        self,
        request_id: str,
        prompts: list[dict[str, Any]],
        params: SamplingParams | BeamSearchParams,
        output_kind: RequestOutputKind,
        params_renamed: dict[str, str] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Queue one engine request per prompt, all or none; return their ids and output streams.

        The caller must ``abort_all(ids)`` when done (a no-op for finished requests): a stream
        that is never iterated cannot abort its request by itself.

        :param params_renamed: engine field -> the request's field, for error messages (for
            several prompts, ``"prompt"`` becomes ``"prompt[i]"`` by itself).
        """
        width = params.beam_width if isinstance(params, BeamSearchParams) else params.n
        self.check_admission(len(prompts) * width)
        added: list[tuple[str, RequestOutputCollector]] = []
        try:
            for i, prompt in enumerate(prompts):
                sub_id = f"{request_id}-{i}"
                try:
                    queue = self.engine.add_request(sub_id, prompt, params, output_kind,
                                                    priority=priority, lora_request=lora_request)
                    added.append((sub_id, queue))
                except InvalidRequestError as exc:
                    renamed = dict(params_renamed or {})
                    if len(prompts) > 1:
                        renamed.setdefault("prompt", f"prompt[{i}]")
                    raise invalid_request(exc, renamed) from None
        except BaseException as exc:
            for sub_id, _ in added:
                self.engine.abort(sub_id)
            if isinstance(exc, EngineDeadError):
                raise engine_dead_error(exc) from None
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


# vLLM's older request fields ``guided_<name>``, each one ``structured_outputs.<name>``.
LEGACY_GUIDED_FIELDS = ("json", "regex", "choice", "grammar")


def structured_outputs_params(
    request: SamplingFields, renamed: dict[str, str]
) -> StructuredOutputsParams | None:
    """The constraint of ``response_format``, ``structured_outputs`` or a ``guided_*`` field
    (at most one of them), or None.

    Adds to ``renamed`` the request's names of the engine's fields, so an error about the
    schema of a ``response_format`` names ``response_format.json_schema.schema``.
    """
    response_format = request.response_format
    if response_format is not None and response_format.type == "text":
        response_format = None
    fields = request.structured_outputs
    guided = {name: getattr(request, f"guided_{name}") for name in LEGACY_GUIDED_FIELDS}
    guided = {name: value for name, value in guided.items() if value is not None}
    given = [name for name, present in (("response_format", response_format is not None),
                                        ("structured_outputs", fields is not None),
                                        *((f"guided_{n}", True) for n in guided)) if present]
    if len(given) > 1:
        raise InvalidRequestError(f"give one of {', '.join(given)}, not several",
                                  param=given[-1])
    if guided:
        (name, value), = guided.items()
        renamed[f"structured_outputs.{name}"] = f"guided_{name}"
        renamed["structured_outputs"] = f"guided_{name}"
        return StructuredOutputsParams(**{name: value})
    if fields is not None:
        return StructuredOutputsParams(
            json=fields.json_, regex=fields.regex, choice=fields.choice, grammar=fields.grammar,
            json_object=fields.json_object, disable_any_whitespace=fields.disable_any_whitespace)
    if response_format is None:
        return None
    if response_format.type == "json_object":
        renamed["structured_outputs.json_object"] = "response_format"
        return StructuredOutputsParams(json_object=True)
    renamed["structured_outputs.json"] = "response_format.json_schema.schema"
    renamed["structured_outputs"] = "response_format"
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.json_schema is None:
        raise InvalidRequestError(
            'response_format of type "json_schema" needs json_schema.schema',
            param="response_format.json_schema")
    return StructuredOutputsParams(json=json_schema.json_schema)


def invalid_request(exc: InvalidRequestError, renamed: dict[str, str] | None = None) -> OpenAIError:
    """The 400 for an engine-side ``InvalidRequestError``, its field named as the client did.

    :param renamed: engine field -> the request's field (e.g. ``max_tokens`` ->
        ``max_completion_tokens`` in chat); the message names the engine's field, so it is
        renamed there too.
    """
    param = exc.param
    message = exc.message
    if param is not None and renamed and param in renamed:
        # Whole field names only ("logprobs", not the word inside "prompt_logprobs").
        message = re.sub(rf"(?<![\w.\[]){re.escape(param)}(?![\w\[])", renamed[param], message)
        param = renamed[param]
    return OpenAIError(message, 400, param=param, code=exc.code)


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
