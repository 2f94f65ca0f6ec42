"""Iteration-level continuous batching with chunked prefill, preemption, swapping, shared
blocks for n > 1 and beam search.

There are no separate prefill and decode phases: every request has ``num_computed_tokens``
and ``num_tokens``, and each step gives it ``min(num_tokens - num_computed_tokens, budget)``
new tokens under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). A decode is a request one token behind; a long prompt is run in chunks.

Three queues: ``running`` (served first, in order: oldest first under FCFS, by priority under
``--scheduling-policy priority``), ``swapped`` (requests preempted by swapping, served next)
and ``waiting`` (new and recomputed requests, served last, only while nothing is swapped).
When the KV pool runs dry, the last running request (the newest, or the lowest priority) is
preempted: recomputed or swapped (``octavo.scheduler.preemption``). No new request is admitted
in a step that preempted.

The completions of an n > 1 request share the prompt: completion 0 computes it, the others are
forked in the step that completes it (they share its blocks and sample their first token from
its logits; the last, partly filled block is copied when a completion first writes into it).
A beam search is a group of beams scheduled together (``octavo.scheduler.beam_search``).

``schedule`` advances each scheduled request's ``num_computed_tokens`` at once, and counts
the token a step will sample as a placeholder until ``update_from_output`` records it. So the
next step can be scheduled before the previous one's results are back (async scheduling, see
``octavo.engine_core.core``): a decode then runs on the token still being sampled, and a request
whose last allowed token is in flight is left out. With one step at a time the placeholders
are resolved before every ``schedule`` and nothing changes.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time

from octavo.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.messages import (
    EngineCoreOutput,
    ForkedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    Request,
    RequestStatus,
    SchedulerOutput,
    SchedulerStats,
)
from octavo.sampling_params import BeamSearchParams
from octavo.scheduler.beam_search import BeamSearchGroup
from octavo.scheduler.preemption import swap_threshold_tokens
from octavo.scheduler.request_queue import FCFSQueue, PriorityQueue, RequestQueue
from octavo.scheduler.spec_decode import Proposer, SpecDecodeStats, make_proposer, may_speculate

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
        num_host_blocks: int = 0,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.config = scheduler_config
        # Most different LoRA adapters running at once (the workers' slots; None: no LoRA).
        self.max_loras = max_loras
        # Speculative decoding: proposes drafts when a request's step is recorded (None: off).
        self.proposer: Proposer | None = None
        self.spec_stats = SpecDecodeStats()
        # KV slots reserved past a sampling step's tokens (the draft model writes its KV of
        # the next step's drafts there; 0 for ngram).
        self.num_lookahead_slots = 0
        if speculative_config is not None:
            assert not scheduler_config.async_scheduling and pipeline_parallel_size == 1, (
                "speculative decoding runs one step at a time (EngineArgs turns async off)")
            self.proposer = make_proposer(speculative_config)
            self.num_lookahead_slots = speculative_config.num_lookahead_slots
        # Pipeline parallelism: up to one step per stage in flight, each of other requests (a
        # request's next step needs its last token, which only the last stage sees), and the
        # workers get the tokens from here (CachedRequestData.new_token_ids).
        self.pipeline_parallel = pipeline_parallel_size > 1
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
            num_host_blocks=num_host_blocks if scheduler_config.preemption_mode == "swap" else 0,
        )
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        if not scheduler_config.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, max_model_len)
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self.swap_threshold = swap_threshold_tokens(self.block_size, self.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = PriorityQueue() if self.by_priority else FCFSQueue()
        self.swapped: RequestQueue = PriorityQueue()
        self.running: list[Request] = []
        self.beam_groups: dict[str, BeamSearchGroup] = {}
        self._admissions = itertools.count()
        # Ids whose worker state must be dropped at the next step.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_preemptions_swap = 0
        # Tokens of the most recently scheduled step.
        self.num_batched_tokens = 0
        # Schedule plain running requests inline (see _schedule_running); False: every
        # request takes the general path (tests compare the two).
        self.inline_decode = True

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(self, request: Request, fork_from: str | None = None) -> None:
        """Queue a request the front end has validated (``octavo.engine.processor``).

        ``fork_from``: the first completion of the same n > 1 request; while that one has not
        started, this one waits to fork its prompt blocks instead of computing them again.
        """
        self._check_new(request, 1)
        request.sort_key = self._sort_key(request)
        self.requests[request.request_id] = request
        leader = self.requests.get(fork_from) if fork_from is not None else None
        if (leader is not None and leader.status == RequestStatus.WAITING
                and leader.first_scheduled_time is None and leader.beam_group is None):
            leader.pending_forks.append(request)
        else:
            self.waiting.add(request)

    def add_beam_search(self, request: Request, params: BeamSearchParams) -> None:
        """Queue a beam search over ``request``'s prompt; its result comes as one
        ``EngineCoreOutput`` with ``beam_sequences`` under ``request.request_id``."""
        self._check_new(request, params.beam_width)
        assert request.request_id not in self.beam_groups, (
            f"request id {request.request_id!r} is already in use")
        eos = frozenset() if params.ignore_eos else frozenset(
            request.sampling_params.all_stop_token_ids)
        group = BeamSearchGroup(request.request_id, params, eos, request.max_tokens,
                                template=request, sort_key_base=self._sort_key(request)[:3])
        self.beam_groups[request.request_id] = group
        self.waiting.add(self._new_root_beam(group))

    def _check_new(self, request: Request, num_sequences: int) -> None:
        worst_case = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        manager = self.kv_cache_manager
        assert manager.blocks_needed(worst_case) <= manager.num_blocks, (
            f"request {request.request_id} can never fit the KV cache: the Processor must refuse it"
        )
        assert num_sequences <= self.config.max_num_seqs, (
            f"request {request.request_id} needs {num_sequences} sequences at once")
        assert request.request_id not in self.requests and request.request_id not in self.beam_groups, (
            f"request id {request.request_id!r} is already in use"
        )

    def _sort_key(self, request: Request, beam_index: int = 0) -> tuple[float, ...]:
        priority = request.priority if self.by_priority else 0
        return (priority, request.arrival_time, next(self._admissions), beam_index)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): free their blocks at once."""
        for request_id in request_ids:
            group = self.beam_groups.get(request_id)
            if group is not None:
                self._end_group(group)
                continue
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            self._remove_from_queues(request)
            request.status = status
            self._free(request)

    def _remove_from_queues(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (its forks wait on their own)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:  # a completion waiting to fork its leader's prompt
            for leader in self.requests.values():
                if request in leader.pending_forks:
                    leader.pending_forks.remove(request)
                    break
        for fork in reversed(request.pending_forks):  # they compute their prompt themselves
            self.waiting.prepend(fork)
        request.pending_forks = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_stats
        num_pending_forks = sum(len(r.pending_forks) for r in self.requests.values())
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + num_pending_forks,
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_batched_tokens=self.num_batched_tokens,
            num_preemptions_swap=self.num_preemptions_swap,
            num_swapped=len(self.swapped),
            host_kv_cache_usage=self.kv_cache_manager.host_usage(),
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_pos),
        )

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV slots."""
        self.kv_cache_manager.begin_step()
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        preempted_any = self._schedule_running(out, self.max_num_batched_tokens)
        if not preempted_any:
            self._schedule_swapped(out)
            if not self.swapped:
                self._schedule_waiting(out)
        copies, replaced = self.kv_cache_manager.take_block_copies()
        out.blocks_to_copy = copies
        if replaced:  # the workers' own blocks change for the requests they already hold
            cached = out.scheduled_cached_reqs
            held = set(cached.req_ids)
            cached.replaced_block_ids = {req_id: pairs for req_id, pairs in replaced.items()
                                         if req_id in held}
        if out.is_empty:
            self.kv_cache_manager.cancel_empty_step()
        else:
            self.num_batched_tokens = out.total_num_scheduled_tokens
        return out

    @staticmethod
    def _advance(request: Request, num_new: int, num_drafts: int = 0) -> None:
        """Count a scheduled step's tokens as computed; one that completes the known tokens
        samples the next token, which is a placeholder until its result comes back.

        ``num_drafts`` of the ``num_new`` tokens are draft tokens after the known ones
        (speculative decoding): counted as computed until the step's result rolls the rejected
        ones back (``update_from_output``); the step's placeholder stands for all it emits."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens - num_drafts == request.num_tokens_with_placeholders:
            request.num_output_placeholders += 1

    def _unit_of(self, request: Request) -> list[Request]:
        """What is scheduled and preempted together: a beam search's beams, else the request."""
        group = request.beam_group
        return list(group.beams) if group is not None else [request]

    def _can_run_now(self, request: Request) -> bool:
        """Whether a running request may be scheduled (its token in flight may be needed)."""
        if not request.num_output_placeholders:
            return True
        return not (self.pipeline_parallel or request.beam_group is not None
                    or request.reached_length_limit(self.max_model_len))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted_any = False
        index = 0
        forked: list[Request] = []
        running = self.running
        # The common running request (one sequence: no beams, drafts, forks waiting on it,
        # pipeline stages or lookahead slots) is scheduled inline: the general path below
        # does the same with about four times the Python per request (docs/benchmarks.md,
        # "host work per step"). Its step usually fits in the blocks it holds; when it needs
        # a block (or a block to index, or a copy), allocate_slots is asked directly; only
        # when the pool is short (or with a sliding window) does the general path run, which
        # preempts.
        plain = self.inline_decode and not (self.pipeline_parallel or self.num_lookahead_slots)
        manager = self.kv_cache_manager
        fits = manager.fits_in_held_blocks
        allocate = manager.allocate_slots if manager.sliding_window is None else None
        cached = out.scheduled_cached_reqs
        cached_req_ids = cached.req_ids
        cached_num_computed = cached.num_computed_tokens
        num_scheduled = out.num_scheduled_tokens
        max_model_len = self.max_model_len
        # Tokens of the requests scheduled inline (added to the step's total at the end).
        num_inline_tokens = 0
        while index < len(running) and budget > 0:
            request = running[index]
            if (plain and request.beam_group is None and not request.spec_token_ids
                    and not request.pending_forks and not request.new_to_workers):
                placeholders = request.num_output_placeholders
                computed = request.num_computed_tokens
                end = len(request.all_token_ids) + placeholders  # num_tokens_with_placeholders
                n = end - computed
                if n <= 0 or (placeholders and (  # request.reached_length_limit, inline
                        len(request.output_token_ids) + placeholders
                        >= request.sampling_params.max_tokens or end >= max_model_len)):
                    index += 1  # nothing to run, or its last token is in flight
                    continue
                if n > budget:
                    n = budget
                new_block_ids: list[int] | None = None
                if fits(request, n):
                    new_block_ids = []
                elif allocate is not None:  # None: the pool is short (nothing was changed)
                    new_block_ids = allocate(request, n)
                if new_block_ids is not None:
                    req_id = request.request_id
                    cached_req_ids.append(req_id)  # CachedRequestData.add, inline
                    cached_num_computed.append(computed)
                    if new_block_ids:
                        cached.new_block_ids[req_id] = new_block_ids
                    num_scheduled[req_id] = n
                    num_inline_tokens += n
                    request.num_computed_tokens = computed + n  # _advance, without drafts
                    if computed + n == end:
                        request.num_output_placeholders = placeholders + 1
                    budget -= n
                    index += 1
                    continue
            unit = self._unit_of(request)
            members = [r for r in unit if self._can_run_now(r)
                       and r.num_tokens_with_placeholders > r.num_computed_tokens]
            if len(members) < len(unit) and unit[0].beam_group is not None:
                members = []  # beams run together (some wait for a token in flight)
            if unit[0].beam_group is not None and len(members) > budget:
                index += len(unit)  # not enough budget for one token per beam: next step
                continue
            num_new: list[int] = []
            drafts: dict[str, list[int]] = {}
            left = budget
            for request in members:
                n = min(request.num_tokens_with_placeholders - request.num_computed_tokens, left)
                if request.spec_token_ids and n == 1:
                    draft = self._drafts_to_verify(request, left - 1)
                    if draft:
                        drafts[request.request_id] = draft
                        n += len(draft)
                num_new.append(n)
                left -= n
            members = [r for r, n in zip(members, num_new) if n > 0]
            num_new = [n for n in num_new if n > 0]
            unit_preempted = False
            while self._blocks_to_allocate(members, num_new) > self.kv_cache_manager.num_free_blocks:
                victims = self._unit_of(self.running[-1])
                self._preempt(victims, out)
                preempted_any = True
                if any(v is unit[0] for v in victims):
                    unit_preempted = True
                    break
            if unit_preempted:
                break
            for request, n in zip(members, num_new):
                self._schedule_running_request(request, n, out, forked,
                                               drafts.get(request.request_id))
                budget -= n
            index += len(unit)
        out.total_num_scheduled_tokens += num_inline_tokens
        for request in forked:
            self._insert_running(request)
        return preempted_any

    def _drafts_to_verify(self, request: Request, room: int) -> list[int]:
        """The request's drafts this step verifies: at most ``room`` of them (the token budget
        left after its last token), and no more than could be emitted (max_tokens,
        max_model_len: a step emits up to drafts + 1 tokens)."""
        room = min(room, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        return request.spec_token_ids[:max(room, 0)]

    def _blocks_to_allocate(self, requests: list[Request], num_new: list[int]) -> int:
        """Blocks the pool must give these running requests (at most: copies-on-write of one
        block shared by several of them are counted for each)."""
        return sum(self.kv_cache_manager.num_blocks_to_allocate(r, n, self._lookahead(r, n))
                   for r, n in zip(requests, num_new))

    def _lookahead(self, request: Request, num_new: int) -> int:
        """KV slots reserved past a step of ``num_new`` tokens: the draft model writes its KV
        of the next drafts there (speculative decoding with a draft model; never past
        max_model_len)."""
        if not self.num_lookahead_slots:
            return 0
        end = request.num_computed_tokens + num_new
        return max(0, min(self.num_lookahead_slots, self.max_model_len - end))

    def _schedule_running_request(self, request: Request, num_new: int, out: SchedulerOutput,
                                  forked: list[Request], drafts: list[int] | None = None) -> None:
        manager = self.kv_cache_manager
        new_block_ids = manager.allocate_slots(
            request, num_new, num_lookahead_tokens=self._lookahead(request, num_new))
        assert new_block_ids is not None, f"{request.request_id}: blocks were counted as free"
        if request.new_to_workers:  # a forked beam the workers have not seen
            request.new_to_workers = False
            out.scheduled_new_reqs.append(self._new_request_data(request))
            request.num_tokens_sent_to_workers = request.num_tokens
        else:
            out.scheduled_cached_reqs.add(request.request_id, request.num_computed_tokens,
                                          new_block_ids, self._tokens_new_to_workers(request))
        out.num_scheduled_tokens[request.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        if drafts:
            out.scheduled_spec_decode_tokens[request.request_id] = drafts
        request.spec_token_ids = []
        self._advance(request, num_new, len(drafts or ()))
        if request.pending_forks and request.num_output_placeholders:
            self._fork_pending(request, out, forked)

    def _lora_fits(self, request: Request) -> bool:
        """Whether ``request`` may run beside the running requests: its adapter is running
        already, or fewer than ``max_loras`` adapters are."""
        lora_id = request.lora_int_id
        if not lora_id or self.max_loras is None:
            return True
        running = {r.lora_int_id for r in self.running if r.lora_int_id}
        return lora_id in running or len(running) < self.max_loras

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            tokens_from_scheduler=request.beam_group is not None,
            lora_request=request.lora_request,
        )

    def _tokens_new_to_workers(self, request: Request) -> list[int]:
        """The tokens the workers have not been sent yet: under pipeline parallelism, and for
        beams (whose tokens the scheduler chooses)."""
        if not (self.pipeline_parallel or request.beam_group is not None):
            return []
        new = request.all_token_ids[request.num_tokens_sent_to_workers:]
        request.num_tokens_sent_to_workers = request.num_tokens
        return new

    def _insert_running(self, request: Request) -> None:
        """Add to ``running``: at the end (FCFS), or at its place by priority."""
        if self.by_priority:
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
        else:
            self.running.append(request)

    def _fork_pending(self, leader: Request, out: SchedulerOutput,
                      forked: list[Request]) -> None:
        """The leader's prompt is complete this step: its waiting completions share its
        blocks and sample from its logits (those beyond max_num_seqs compute on their own)."""
        forks, leader.pending_forks = leader.pending_forks, []
        now = time.time()
        for i, child in enumerate(forks):
            if len(self.running) + len(forked) >= self.config.max_num_seqs:
                for rest in reversed(forks[i:]):
                    self.waiting.prepend(rest)
                return
            self.kv_cache_manager.fork(leader, child)
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_output_placeholders = 1
            child.num_tokens_sent_to_workers = child.num_tokens
            child.num_cached_tokens = leader.num_cached_tokens
            child.first_scheduled_time = now
            out.forked_reqs.append(ForkedRequestData(
                req_id=child.request_id,
                parent_req_id=leader.request_id,
                sampling_params=child.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(child.request_id),
                num_computed_tokens=child.num_computed_tokens,
            ))
            forked.append(child)

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        """Swap requests back in, oldest (or highest priority) first, each whole unit or none."""
        manager = self.kv_cache_manager
        budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
        while self.swapped and budget > 0:
            head = self.swapped.peek()
            unit = self._unit_of(head)
            if any(r.num_output_placeholders for r in unit):
                break  # swapped with a token in flight: resume once it is recorded
            if not self._lora_fits(head):
                break  # its adapter waits for a slot
            if len(self.running) + len(unit) > self.config.max_num_seqs or budget < len(unit):
                break
            num_new = []
            left = budget
            for request in unit:
                n = min(request.num_tokens - request.num_computed_tokens, left)
                num_new.append(n)
                left -= n
            needed = sum(manager.num_blocks_to_swap_in(r, n) for r, n in zip(unit, num_new))
            if needed > manager.num_free_blocks:
                break
            for request, n in zip(unit, num_new):
                self.swapped.remove(request)
                out.blocks_to_swap_in += manager.swap_in(request)
                new_block_ids = manager.allocate_slots(request, n)
                assert new_block_ids is not None, "blocks were counted as free"
                request.status = RequestStatus.RUNNING
                request.new_to_workers = False
                self._insert_running(request)
                out.scheduled_new_reqs.append(self._new_request_data(request))
                request.num_tokens_sent_to_workers = request.num_tokens
                out.num_scheduled_tokens[request.request_id] = n
                out.total_num_scheduled_tokens += n
                self._advance(request, n)
                budget -= n

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        manager = self.kv_cache_manager
        budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it is recorded
            group = request.beam_group
            if group is not None and len(self.running) + group.beam_width > self.config.max_num_seqs:
                break  # room for every beam it will have
            if not self._lora_fits(request):
                break  # its adapter waits for a slot (served in order, as any request)
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            lookahead = 0
            if self.num_lookahead_slots:
                end = num_hit_tokens + num_new
                lookahead = max(0, min(self.num_lookahead_slots, self.max_model_len - end))
            new_block_ids = manager.allocate_slots(request, num_new, hit_blocks, num_hit_tokens,
                                                   lookahead)
            if new_block_ids is None:
                break
            self.waiting.pop()
            self._insert_running(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            request.new_to_workers = False
            request.num_tokens_sent_to_workers = request.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            out.scheduled_new_reqs.append(self._new_request_data(request))
            out.num_scheduled_tokens[request.request_id] = num_new
            out.total_num_scheduled_tokens += num_new
            self._advance(request, num_new)
            budget -= num_new
            if request.pending_forks and request.num_output_placeholders:
                forked: list[Request] = []
                self._fork_pending(request, out, forked)
                for child in forked:
                    self._insert_running(child)

    # ---- preemption --------------------------------------------------------------------

    def _should_swap(self, unit: list[Request]) -> bool:
        """The rule of ``octavo.scheduler.preemption``."""
        manager = self.kv_cache_manager
        if manager.host_pool is None or not manager.can_swap_out(unit):
            return False
        if unit[0].beam_group is not None:
            return not any(r.num_output_placeholders for r in unit)
        return unit[0].num_computed_tokens >= self.swap_threshold

    def _preempt(self, unit: list[Request], out: SchedulerOutput) -> None:
        """Preempt a running unit (a request, or a beam search's beams) to free KV blocks."""
        swap = self._should_swap(unit)
        mode = "swap" if swap else "recompute"
        logger.debug("preempting %s (%s) to free KV blocks",
                     ", ".join(r.request_id for r in unit), mode)
        for request in unit:
            self.running.remove(request)
            request.spec_token_ids = []
        self.num_preemptions += 1
        self.num_preemptions_swap += int(swap)
        group = unit[0].beam_group
        if group is not None and not swap:
            self._restart_group(group)
            return
        for request in reversed(unit):  # prepended: they keep their order
            request.num_preemptions += 1
            out.finished_req_ids.add(request.request_id)
            if swap:
                out.blocks_to_swap_out += self.kv_cache_manager.swap_out(request)
                request.status = RequestStatus.SWAPPED
                self.swapped.add(request)
            else:
                self.kv_cache_manager.free(request)
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                self.waiting.prepend(request)

    def discard_steps(self, scheduler_outputs: list[SchedulerOutput]) -> None:
        """Undo every scheduled step whose results were not recorded (one of them raised).

        Their KV writes and block moves may not have happened: the prefixes they would have
        filled are forgotten, tokens they were sampling are dropped, every request they
        scheduled or forked is reset to be recomputed from scratch (its worker state dropped),
        exactly like a preemption, requests swapped out by them are recomputed instead, and
        beam searches they touched restart. Nothing else changes.
        """
        self.kv_cache_manager.discard_steps()
        step_ids: set[str] = set()
        swapped_out = False
        for scheduler_output in scheduler_outputs:
            self._finished_req_ids |= scheduler_output.finished_req_ids
            step_ids.update(scheduler_output.num_scheduled_tokens)
            step_ids.update(f.req_id for f in scheduler_output.forked_reqs)
            swapped_out = swapped_out or bool(scheduler_output.blocks_to_swap_out)
        for request in self.waiting:
            request.num_output_placeholders = 0  # preempted while a discarded step sampled
        groups: dict[str, BeamSearchGroup] = {}
        for request in list(self.swapped):
            request.num_output_placeholders = 0
            if not swapped_out:
                continue
            if request.beam_group is not None:
                groups[request.beam_group.group_id] = request.beam_group
                continue
            self.swapped.remove(request)
            self.kv_cache_manager.free(request)
            self._reset_to_waiting(request)
        for request in reversed([r for r in self.running if r.request_id in step_ids]):
            if request.beam_group is not None:
                groups[request.beam_group.group_id] = request.beam_group
                continue
            self.running.remove(request)
            self.kv_cache_manager.free(request)
            self._reset_to_waiting(request)
        for group in groups.values():
            self._restart_group(group)

    def _reset_to_waiting(self, request: Request) -> None:
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)
        self._finished_req_ids.add(request.request_id)

    # ---- beam search -------------------------------------------------------------------

    def _new_root_beam(self, group: BeamSearchGroup) -> Request:
        """The search's first beam: the prompt alone."""
        assert group.template is not None
        root = group.template.fork(group.new_beam_id())
        root.status = RequestStatus.WAITING
        root.num_computed_tokens = 0
        root.sort_key = (*group.sort_key_base, group.num_beams_made)
        group.add_beam(root, 0.0, [])
        self.requests[root.request_id] = root
        return root

    def _restart_group(self, group: BeamSearchGroup) -> None:
        """Preempted by recompute: drop every beam; the search starts again from its prompt."""
        for beam in group.beams:
            if beam.status == RequestStatus.RUNNING and beam in self.running:
                self.running.remove(beam)
            elif beam.status == RequestStatus.SWAPPED:
                self.swapped.remove(beam)
            elif beam in self.waiting:
                self.waiting.remove(beam)
            self.kv_cache_manager.free(beam)
            self._finished_req_ids.add(beam.request_id)
            del self.requests[beam.request_id]
        group.restart()
        root = self._new_root_beam(group)
        root.status = RequestStatus.PREEMPTED
        root.num_preemptions += 1
        self.waiting.prepend(root)

    def _end_group(self, group: BeamSearchGroup) -> None:
        for beam in group.beams:
            if beam.status == RequestStatus.RUNNING:
                self.running.remove(beam)
            elif beam.status == RequestStatus.SWAPPED:
                self.swapped.remove(beam)
            elif beam in self.waiting:
                self.waiting.remove(beam)
            beam.status = RequestStatus.FINISHED_ABORTED
            self._free(beam)
        group.beams.clear()
        del self.beam_groups[group.group_id]

    def _record_beam(self, beam: Request, runner_output: ModelRunnerOutput,
                     sampled: list[int], outputs: list[EngineCoreOutput]) -> None:
        """A beam's step came back: keep its candidates; once every beam has reported, choose
        the next beams (or end the search)."""
        group: BeamSearchGroup = beam.beam_group
        if not sampled:
            return  # a prompt chunk that did not end the prompt
        beam.num_output_placeholders -= len(sampled)
        lists = runner_output.logprobs[beam.request_id]
        top = list(zip(lists.token_ids[0][1:], lists.logprobs[0][1:]))
        group.record(beam, top)
        if group.ready:
            self._advance_beams(group, outputs)

    def _advance_beams(self, group: BeamSearchGroup, outputs: list[EngineCoreOutput]) -> None:
        old = list(group.beams)
        continuations = group.select()
        if continuations is None:
            best = group.finished[0] if group.finished else None
            outputs.append(EngineCoreOutput(
                request_id=group.group_id,
                new_token_ids=[],
                finish_reason=best.finish_reason if best is not None else "length",
                num_cached_tokens=max(old[0].num_cached_tokens, 0),
                first_scheduled_time=old[0].first_scheduled_time,
                beam_sequences=group.result(),
            ))
            self._end_group(group)
            return
        manager = self.kv_cache_manager
        cumulative = dict(group.cumulative_logprobs)
        logprobs = dict(group.token_logprobs)
        # Forks first, from the parents' tokens before any parent takes its own new token.
        chosen: set[str] = set()
        new_beams: list[Request] = []
        for continuation in continuations:
            parent = continuation.parent
            if parent.request_id not in chosen:
                chosen.add(parent.request_id)
                new_beams.append(parent)
                continue
            child = parent.fork(group.new_beam_id())
            manager.fork(parent, child)
            child.new_to_workers = True
            child.sort_key = (*group.sort_key_base, group.num_beams_made)
            self.requests[child.request_id] = child
            new_beams.append(child)
        position = min(self.running.index(b) for b in old)
        for beam in old:
            self.running.remove(beam)
            if beam.request_id not in chosen:
                beam.status = RequestStatus.FINISHED_STOPPED
                self._free(beam)
        group.beams.clear()
        group.cumulative_logprobs.clear()
        group.token_logprobs.clear()
        for beam, continuation in zip(new_beams, continuations):
            beam.append_output_token(continuation.token_id)
            parent_id = continuation.parent.request_id
            group.add_beam(beam, continuation.cumulative_logprob,
                           logprobs[parent_id] + [continuation.logprob])
            assert abs(cumulative[parent_id] + continuation.logprob
                       - continuation.cumulative_logprob) < 1e-3
        if self.by_priority:
            for beam in new_beams:
                self._insert_running(beam)
        else:
            self.running[position:position] = new_beams

    # ---- results -----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Record the results of the oldest step not yet recorded; return what each request
        produced.

        Tokens of requests that finished meanwhile (aborted, or stopped by an earlier step
        while this one was in flight) are dropped. A request preempted meanwhile keeps its
        token: it is recomputed (or swapped back in) with it.
        """
        self.kv_cache_manager.commit_step()
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        # The common row (a running single sequence that sampled one token, no prompt
        # logprobs, drafts or proposer) is recorded inline: the general path below does the
        # same with several times the Python per request (docs/benchmarks.md, "host work per
        # step").
        plain = not (runner_output.prompt_logprobs or self.proposer is not None
                     or scheduler_output.scheduled_spec_decode_tokens)
        logprobs = runner_output.logprobs
        running = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None:
                continue
            if (plain and len(sampled) == 1 and request.status is running
                    and request.beam_group is None):
                request.num_output_placeholders -= 1
                finished = request.append_token_and_check_stop(sampled[0], max_model_len)
                num_cached = request.num_cached_tokens
                outputs.append(EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=list(sampled),
                    finish_reason=request.status.value if finished else None,
                    stop_reason=request.stop_reason,
                    new_logprobs=logprobs.get(req_id) if logprobs else None,
                    num_cached_tokens=num_cached if num_cached > 0 else 0,
                    first_scheduled_time=request.first_scheduled_time,
                ))
                if finished:
                    request.num_output_placeholders = 0
                    self._remove_finished(request)
                continue
            if request.status.is_finished:
                continue
            if request.beam_group is not None:
                self._record_beam(request, runner_output, sampled, outputs)
                continue
            computed = runner_output.prompt_logprobs.get(req_id)
            prompt_logprobs = None
            if computed is not None:
                prompt_logprobs = self._new_prompt_logprobs(
                    request, computed, scheduler_output.num_computed_before(req_id)
                )
            finished = False
            num_emitted = 0
            if sampled:
                request.num_output_placeholders -= 1  # one per step, however many it emits
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:
                # Rejected drafts' KV slots are free again: the next step rewrites them
                # before anything reads them (attention reads only positions < seq_len).
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                self.spec_stats.record(len(drafts), len(sampled) - 1)
            for token_id in sampled:
                num_emitted += 1
                request.append_output_token(token_id)
                if request.check_stop(self.max_model_len):
                    finished = True
                    break
            if not sampled and prompt_logprobs is None:
                continue
            if not finished and self.proposer is not None and sampled and may_speculate(request):
                request.spec_token_ids = self.proposer.propose(request, runner_output)
            new_logprobs = runner_output.logprobs.get(req_id)
            if new_logprobs is not None and num_emitted < len(sampled):
                new_logprobs = new_logprobs.head(num_emitted)  # a stop cut the accepted drafts
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=list(sampled[:num_emitted]),
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=request.first_scheduled_time,
                )
            )
            if finished:
                request.num_output_placeholders = 0
                self._remove_finished(request)
        return outputs

    def _remove_finished(self, request: Request) -> None:
        """A request that just finished (its status is final): out of its queue, blocks freed.
        It may be running, or preempted or swapped while its last token was sampled."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)

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
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self._finished_req_ids.add(request.request_id)
        for fork in reversed(request.pending_forks):  # they compute their prompt themselves
            self.waiting.prepend(fork)
        request.pending_forks = []
        del self.requests[request.request_id]
