"""``LLMEngine``: the in-process engine behind ``octavo.LLM`` (front end + engine core)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from octavo.config import EngineConfig
from octavo.engine.arg_utils import EngineArgs
from octavo.engine.output_processor import OutputProcessor, RequestOutputKind
from octavo.engine.processor import KVCacheCapacity, ProcessedPrompt, Processor, PromptType
from octavo.engine.tokenizer import eos_token_ids, load_tokenizer
from octavo.engine_core.core import EngineCore
from octavo.lora_request import LoRARequest
from octavo.messages import SchedulerStats
from octavo.outputs import RequestOutput
from octavo.plugins import get_plugin_manager
from octavo.sample.logits_processor import LogitsProcessorRegistry
from octavo.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Tokenize -> schedule/run (EngineCore) -> detokenize, all in the caller's process."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.model_config.seed)
        start = time.perf_counter()
        self.tokenizer = load_tokenizer(config.model_config)
        self.processor = Processor(
            config.model_config, self.tokenizer, eos_token_ids(config.model_config, self.tokenizer),
            backend=config.backend, capabilities=config.backend_capabilities,
            scheduling_policy=config.scheduler_config.scheduling_policy,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            logits_processors=LogitsProcessorRegistry(get_plugin_manager()),
            lora_config=config.lora_config,
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, stream_interval=config.scheduler_config.stream_interval)
        core_start = time.perf_counter()
        self.engine_core = EngineCore(config)
        self.processor.kv_cache = KVCacheCapacity(
            self.engine_core.num_blocks, config.cache_config.block_size
        )
        # Seconds each start-up phase took (the from_engine_args log line sums them up).
        self.startup_seconds = {"tokenizer": core_start - start,
                                "weights + KV cache": time.perf_counter() - core_start}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        from octavo.logger import configure_logging

        configure_logging()
        start = time.perf_counter()
        config = args.create_engine_config()
        config_seconds = time.perf_counter() - start
        engine = cls(config)
        phases = {"config": config_seconds, **engine.startup_seconds}
        logger.info("engine ready in %.1f s (%s)", time.perf_counter() - start,
                    ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
        return engine

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedPrompt:
        """Validate and queue a request, all or nothing; return it as the engine core got it
        (each completion's resolved ``sampling_params``: ``max_tokens`` clipped to the room
        left in ``max_model_len``, ...).

        Raises ``octavo.errors.InvalidRequestError`` (a ``ValueError``) for bad input, with
        nothing queued.

        ``output_kind`` says what ``step()`` returns for it: a snapshot every step it changed
        (CUMULATIVE), only what is new (DELTA), or one snapshot when it finishes (FINAL_ONLY).
        ``params`` may be a ``BeamSearchParams``: a beam search, whose one output comes when
        it finishes. ``priority`` orders requests under ``--scheduling-policy priority``.
        """
        if self.output_processor.child_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.processor.process_any(request_id, prompt, params, arrival_time,
                                               priority, lora_request)
        for core_request in processed.core_requests:
            self.engine_core.add_request(core_request)
        self.output_processor.add_request(request_id, processed, output_kind)
        return processed

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (by the ids given to add_request); their blocks are freed at once."""
        outputs = []
        for request_id in request_ids:
            self.engine_core.abort_requests(self.output_processor.child_ids(request_id))
            final = self.output_processor.abort_request(request_id)
            if final is not None:
                outputs.append(final)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return snapshots of requests that changed (finished ones last seen)."""
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.stopped_req_ids:
            self.engine_core.finish_requests_stopped(processed.stopped_req_ids)
        return processed.request_outputs

    def stats(self) -> SchedulerStats:
        return self.engine_core.stats()

    def reset_prefix_cache(self) -> bool:
        """See ``EngineCore.reset_prefix_cache``."""
        return self.engine_core.reset_prefix_cache()

    @property
    def num_free_blocks(self) -> int:
        return self.engine_core.scheduler.kv_cache_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    def shutdown(self) -> None:
        self.engine_core.shutdown()
