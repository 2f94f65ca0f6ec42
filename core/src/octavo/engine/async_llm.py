"""``AsyncLLM``: the online engine — front end here, ``EngineCore`` in a background process.

This process tokenizes (``Processor``), detokenizes and applies stop strings
(``OutputProcessor``) and hands each request's outputs to whoever awaits them; the scheduler
and the model run in the engine-core process (``core_proc``), reached through
``EngineCoreClient``. Everything here runs on one asyncio event loop:

    engine = await AsyncLLM.from_engine_args(EngineArgs(model=...))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(output.outputs[0].text, end="")     # DELTA outputs: only what is new
    await engine.shutdown()

Leaving the ``async for`` early (break, cancellation, a client gone) aborts the request in the
core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from octavo.engine.arg_utils import EngineArgs
from octavo.engine.core_client import (
    CoreAddresses,
    EngineCoreClient,
    EngineDeadError,
    EngineShuttingDownError,
)
from octavo.engine.output_collector import RequestOutputCollector
from octavo.engine.output_processor import OutputProcessor, RequestOutputKind
from octavo.engine.processor import KVCacheCapacity, Processor, PromptType
from octavo.engine.stats import IterationStats, StatLogger
from octavo.engine.tokenizer import eos_token_ids, load_tokenizer
from octavo.lora_request import LoRARequest
from octavo.messages import SchedulerStats
from octavo.messages.engine_core import (
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreUtilityResult,
)
from octavo.outputs import RequestOutput
from octavo.plugins import get_plugin_manager
from octavo.sample.logits_processor import LogitsProcessorRegistry
from octavo.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineShuttingDownError",
    "IterationStats",
    "RequestOutputKind",
    "StatLogger",
]


class AsyncLLM:
    """Online engine: ``generate`` is an async iterator of ``RequestOutput``s.

    A ``max_tokens`` beyond the room the prompt leaves in ``max_model_len`` is refused
    (``context_length_exceeded``, as OpenAI does) unless ``clip_max_tokens``, where it is
    lowered to that room as ``octavo.LLM`` does.

    ``attach``: use an engine core started by someone else (one front end of several:
    ``octavo serve --api-server-count``) instead of spawning one; ``shutdown`` then aborts
    this front end's requests and leaves the core running.
    """

    def __init__(self, engine_args: EngineArgs, clip_max_tokens: bool = False,
                 attach: CoreAddresses | None = None) -> None:
        self.engine_args = engine_args
        # Resolves the model and the backend; loads no weights (the core does). The core
        # process gets this config as it is: the model's config is read once.
        self.config = engine_args.create_engine_config()
        self.model_config = self.config.model_config
        self.tokenizer = load_tokenizer(self.model_config)
        self.processor = Processor(
            self.model_config, self.tokenizer, eos_token_ids(self.model_config, self.tokenizer),
            backend=self.config.backend, capabilities=self.config.backend_capabilities,
            clip_max_tokens=clip_max_tokens,
            scheduling_policy=self.config.scheduler_config.scheduling_policy,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            logits_processors=LogitsProcessorRegistry(get_plugin_manager()),
            lora_config=self.config.lora_config,
        )
        # The front end's one record of live requests and their completions.
        self.output_processor = OutputProcessor(
            self.tokenizer, stream_interval=self.config.scheduler_config.stream_interval)
        self.core = EngineCoreClient(attach)
        # Set by start(): what the core reported once the model was loaded.
        self.core_info: EngineCoreReady | None = None
        # Latest scheduler snapshot from the core.
        self.scheduler_stats = SchedulerStats.idle()
        self.stat_loggers: list[StatLogger] = []
        # Why the engine is dead, once it is (None while healthy).
        self.dead_reason: str | None = None
        self._dead_callbacks: list[Callable[[str], None]] = []
        # Where each unfinished request's outputs wait for its consumer (merged while it lags).
        self._queues: dict[str, RequestOutputCollector] = {}
        self._utility_calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._call_ids = itertools.count()
        self._output_task: asyncio.Task[None] | None = None
        self._shutting_down = False

    @classmethod
    async def from_engine_args(
        cls, engine_args: EngineArgs, clip_max_tokens: bool = False,
        attach: CoreAddresses | None = None,
    ) -> AsyncLLM:
        engine = cls(engine_args, clip_max_tokens=clip_max_tokens, attach=attach)
        try:
            await engine.start()
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    async def start(self) -> None:
        """Spawn the engine core, wait for the model to load, start reading its outputs."""
        self.core_info = await self.core.start(self.config, self._on_core_exit)
        info = self.core_info
        self.processor.kv_cache = KVCacheCapacity(info.num_blocks, info.block_size)
        if info.stats is not None:  # counters since start-up: a first run's baseline
            self.scheduler_stats = info.stats
        self._output_task = asyncio.create_task(self._output_loop(), name="octavo-output-loop")

    # ---- properties -----------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    @property
    def num_waiting_requests(self) -> int:
        """Completions queued but not running (the core's view plus what is on its way).

        Attached (one front end of several): the core's count as of its last step, which
        includes every front end's requests but not those on their way.
        """
        if self.core.attached is not None:
            return self.scheduler_stats.num_waiting
        return max(
            self.output_processor.num_unfinished_completions - self.scheduler_stats.num_running, 0
        )

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, if the engine core dies unexpectedly."""
        self._dead_callbacks.append(callback)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate and queue a request, all or nothing (a ``BeamSearchParams``: a beam
        search, with one output when it finishes; ``priority``: see ``--scheduling-policy``).

        :raises octavo.errors.InvalidRequestError: bad input (``ValueError``/``TypeError``);
            nothing was recorded.
        :raises EngineDeadError: the engine core is gone.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.processor.process_any(request_id, prompt, params, arrival_time,
                                               priority, lora_request)
        queue = RequestOutputCollector(merge_deltas=output_kind is RequestOutputKind.DELTA)
        self.output_processor.add_request(request_id, processed, output_kind)
        self._queues[request_id] = queue
        try:
            self.core.add_requests(processed.core_requests)
        except BaseException:
            # Nothing may stay behind: the front end's records are undone (the core got
            # nothing: the message was not sent).
            self.output_processor.abort_request(request_id)
            self._queues.pop(request_id, None)
            raise
        return queue

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; the last one has ``finished`` set.

        :raises ValueError: bad input (before anything is yielded) or refused by the core.
        :raises EngineDeadError: the engine core died.
        """
        queue = self.add_request(request_id, prompt, params, output_kind, priority=priority,
                                 lora_request=lora_request)
        async for output in self.iterate_outputs(request_id, queue):
            yield output

    async def iterate_outputs(
        self, request_id: str, queue: RequestOutputCollector
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued with ``add_request`` (aborts it if left early).

        DELTA outputs that arrive while the consumer is busy come merged into one
        (``RequestOutputCollector``): the deltas still join up to the whole output.
        """
        try:
            while True:
                item = queue.get_nowait() or await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._queues:  # left early: cancelled, client gone, error
                self.abort(request_id)

    def abort_all(self, error: BaseException) -> int:
        """Stop every unfinished request now: each one's output stream raises ``error``, and
        its blocks are freed in the core. Returns how many were stopped."""
        request_ids = list(self._queues)
        for request_id in request_ids:
            queue = self._queues[request_id]
            self.abort(request_id)
            queue.put_nowait(error)
        return len(request_ids)

    def abort(self, request_id: str) -> None:
        """Stop a request now (its blocks are freed in the core); unknown ids are ignored."""
        child_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort_request(request_id)
        self._queues.pop(request_id, None)
        if child_ids and self.dead_reason is None:
            self.core.abort_requests(child_ids)

    # ---- utility calls --------------------------------------------------------------------

    async def call_utility(self, method: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Call a whitelisted method in the core (``ping``, ``kv_cache_stats``,
        ``reset_prefix_cache``)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        try:
            self.core.call_utility(call_id, method)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        """Forget the core's cached prompt prefixes (``EngineCore.reset_prefix_cache``):
        False while a request holds blocks."""
        return bool((await self.call_utility("reset_prefix_cache"))["reset"])

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` unless the core is alive and answers."""
        if self.dead_reason is not None or not self.core.is_alive():
            raise EngineDeadError(self.dead_reason or "the engine core process is not running")

    # ---- the output loop ------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                event = await self.core.receive()
                if isinstance(event, EngineCoreOutputs):
                    self._process_outputs(event)
                elif isinstance(event, EngineCoreUtilityResult):
                    self._resolve_utility(event)
                elif isinstance(event, EngineCoreFailed):
                    self._set_dead(f"the engine core failed: {event.message}")
                    return
                else:
                    logger.warning("unexpected message from the engine core: %r", event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here would hang every request: fail them instead
            logger.exception("output loop failed")
            self._set_dead(f"the output loop failed: {type(exc).__name__}: {exc}")

    def _process_outputs(self, event: EngineCoreOutputs) -> None:
        processed = self.output_processor.process_outputs(event.outputs)
        if processed.stopped_req_ids:
            self.core.abort_requests(processed.stopped_req_ids, stopped=True)
        for output in processed.request_outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue
            queue.put_nowait(output)
            if output.finished:
                del self._queues[output.request_id]
        for child_id, message in event.rejected.items():
            parent_id = self.output_processor.parent_id(child_id)
            if parent_id is None:
                continue
            queue = self._queues.get(parent_id)
            self.abort(parent_id)
            if queue is not None:
                queue.put_nowait(ValueError(message))
        self.scheduler_stats = event.stats
        for stat_logger in self.stat_loggers:
            stat_logger.record(event.stats, processed.iteration_stats)

    def _resolve_utility(self, event: EngineCoreUtilityResult) -> None:
        future = self._utility_calls.get(event.call_id)
        if future is None or future.done():
            return
        if event.error is not None:
            future.set_exception(RuntimeError(event.error))
        else:
            future.set_result(event.result or {})

    # ---- death and shutdown ---------------------------------------------------------------

    def _on_core_exit(self) -> None:
        if not self._shutting_down:
            if self.core.process is None:  # attached: not our child, its exit code is not ours
                self._set_dead(f"the engine core process (pid {self.core.pid}) exited "
                               "unexpectedly")
                return
            code = self.core.process.exitcode
            self._set_dead(f"the engine core process exited unexpectedly (exit code {code})")

    def _set_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine dead: %s", reason)
        self.core.kill()  # whatever state it is in, it will not be used again
        error = EngineDeadError(reason)
        for request_id, queue in self._queues.items():
            self.output_processor.abort_request(request_id)
            queue.put_nowait(error)
        self._queues.clear()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        if self._output_task is not None and self._output_task is not asyncio.current_task():
            self._output_task.cancel()
        for callback in self._dead_callbacks:
            callback(reason)

    async def shutdown(self) -> None:
        """Stop the core process (gracefully, then by force) and release everything."""
        self._shutting_down = True
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        child_ids = [child for request_id in self._queues
                     for child in self.output_processor.child_ids(request_id)]
        for queue in self._queues.values():
            queue.put_nowait(EngineShuttingDownError("the engine is shutting down"))
        self._queues.clear()
        self.core.shutdown(request_ids=child_ids)
