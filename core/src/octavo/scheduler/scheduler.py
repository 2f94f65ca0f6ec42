"""Iteration-level continuous batching with chunked prefill and preemption by recompute.

There are no separate prefill and decode phases: every request has ``num_computed_tokens``
and ``num_tokens``, and each step gives it ``min(num_tokens - num_computed_tokens, budget)``
new tokens under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). A decode is a request one token behind; a long prompt is run in chunks.

Order of service: running requests first (oldest first), then waiting ones (FCFS). When the KV
pool runs dry, the newest running request is preempted: its blocks are freed and it goes back
to the head of the waiting queue, to be recomputed from its prompt and the tokens it had
generated (greedy output is identical; seeded sampling too, see ``octavo.sample``).

``schedule`` advances each scheduled request's ``num_computed_tokens`` at once, and counts
the token a step will sample as a placeholder until ``update_from_output`` records it. So the
next step can be scheduled before the previous one's results are back (async scheduling, see
``octavo.engine_core.core``): a decode then runs on the token still being sampled, and a request
whose last allowed token is in flight is left out. With one step at a time the placeholders
are resolved before every ``schedule`` and nothing changes.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from octavo.config import CacheConfig, SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.messages import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    Request,
    RequestStatus,
    SchedulerOutput,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides each step's batch; owns the requests' lifecycle in the engine core."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self.config = scheduler_config
        # Pipeline parallelism: up to one step per stage in flight, each of other requests (a
        # request's next step needs its last token, which only the last stage sees), and the
        # workers get the tokens from here (CachedRequestData.new_token_ids).
        self.pipeline_parallel = pipeline_parallel_size > 1
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
        )
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        if not scheduler_config.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, max_model_len)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids whose worker state must be dropped at the next step.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Tokens of the most recently scheduled step.
        self.num_batched_tokens = 0

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request the front end has validated (``octavo.engine.processor``)."""
        worst_case = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        manager = self.kv_cache_manager
        assert manager.blocks_needed(worst_case) <= manager.num_blocks, (
            f"request {request.request_id} can never fit the KV cache: the Processor must refuse it"
        )
        assert request.request_id not in self.requests, (
            f"request id {request.request_id!r} is already in use"
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): free their blocks at once."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_batched_tokens=self.num_batched_tokens,
        )

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV slots."""
        self.kv_cache_manager.begin_step()
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.max_num_batched_tokens
        preempted_any = self._schedule_running(out, budget)
        budget -= out.total_num_scheduled_tokens
        if not preempted_any:
            self._schedule_waiting(out, budget)
        if out.is_empty:
            self.kv_cache_manager.cancel_empty_step()
        else:
            self.num_batched_tokens = out.total_num_scheduled_tokens
        return out

    @staticmethod
    def _advance(request: Request, num_new: int) -> None:
        """Count a scheduled step's tokens as computed; one that completes the known tokens
        samples the next token, which is a placeholder until its result comes back."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens_with_placeholders:
            request.num_output_placeholders += 1

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted_any = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_output_placeholders and (
                self.pipeline_parallel or request.reached_length_limit(self.max_model_len)
            ):
                # Its token is being sampled: under pipeline parallelism its next step waits
                # for it; otherwise the token was its last allowed one.
                index += 1
                continue
            num_new = min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted_any = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            out.scheduled_cached_reqs.append(CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens,
                self._tokens_new_to_workers(request),
            ))
            out.num_scheduled_tokens[request.request_id] = num_new
            out.total_num_scheduled_tokens += num_new
            self._advance(request, num_new)
            budget -= num_new
            index += 1
        return preempted_any

    def _tokens_new_to_workers(self, request: Request) -> list[int]:
        """Under pipeline parallelism, the tokens the workers have not been sent yet."""
        if not self.pipeline_parallel:
            return []
        new = request.all_token_ids[request.num_tokens_sent_to_workers:]
        request.num_tokens_sent_to_workers = request.num_tokens
        return new

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        manager = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it is recorded
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            new_block_ids = manager.allocate_slots(request, num_new, hit_blocks, num_hit_tokens)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            request.num_tokens_sent_to_workers = request.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                )
            )
            out.num_scheduled_tokens[request.request_id] = num_new
            out.total_num_scheduled_tokens += num_new
            self._advance(request, num_new)
            budget -= num_new

    def discard_steps(self, scheduler_outputs: list[SchedulerOutput]) -> None:
        """Undo every scheduled step whose results were not recorded (one of them raised).

        Their KV writes may not have happened: the prefixes they would have filled are
        forgotten, tokens they were sampling are dropped, and every request they scheduled is
        reset to be recomputed from scratch (its worker state dropped), exactly like a
        preemption. Nothing else changes.
        """
        self.kv_cache_manager.discard_steps()
        step_ids: set[str] = set()
        for scheduler_output in scheduler_outputs:
            self._finished_req_ids |= scheduler_output.finished_req_ids
            step_ids.update(scheduler_output.num_scheduled_tokens)
        for request in self.waiting:
            request.num_output_placeholders = 0  # preempted while a discarded step sampled
        for request in reversed([r for r in self.running if r.request_id in step_ids]):
            self.running.remove(request)
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.num_preemptions += 1
            self.waiting.appendleft(request)
            self._finished_req_ids.add(request.request_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        logger.debug("preempting %s to free KV blocks", request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.finished_req_ids.add(request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Record the results of the oldest step not yet recorded; return what each request
        produced.

        Tokens of requests that finished meanwhile (aborted, or stopped by an earlier step
        while this one was in flight) are dropped. A request preempted meanwhile keeps its
        token: it is recomputed with it.
        """
        self.kv_cache_manager.commit_step()
        outputs: list[EngineCoreOutput] = []
        for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue
            computed = runner_output.prompt_logprobs.get(req_id)
            prompt_logprobs = None
            if computed is not None:
                prompt_logprobs = self._new_prompt_logprobs(
                    request, computed, scheduler_output.num_computed_before(req_id)
                )
            was_running = request.status == RequestStatus.RUNNING
            finished = False
            for token_id in sampled:
                request.num_output_placeholders -= 1
                request.append_output_token(token_id)
                if request.check_stop(self.max_model_len):
                    finished = True
                    break
            if not sampled and prompt_logprobs is None:
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=list(sampled),
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=runner_output.logprobs.get(req_id),
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=request.first_scheduled_time,
                )
            )
            if finished:
                request.num_output_placeholders = 0
                if was_running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)  # preempted while its last token was sampled
                self._free(request)
        return outputs

    @staticmethod
    def _new_prompt_logprobs(
        request: Request, computed: LogprobsLists, start: int
    ) -> LogprobsLists | None:
        """The part of a step's prompt logprobs not already sent (row i is position
        ``start + i``, ``start`` being the tokens computed before that step).

        A request recomputed after preemption recomputes its prompt logprobs from position 0;
        the positions sent before the preemption must not be sent again.
        """
        skip = max(request.num_prompt_logprobs_sent - start, 0)
        request.num_prompt_logprobs_sent = max(
            request.num_prompt_logprobs_sent, start + len(computed.ranks)
        )
        if skip == 0:
            return computed
        if skip >= len(computed.ranks):
            return None
        return LogprobsLists(
            computed.token_ids[skip:], computed.logprobs[skip:], computed.ranks[skip:]
        )

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
