"""``EngineCore``: the scheduler + executor loop, free of tokenization and text.

Runs in the caller's process for the offline ``LLM``; the online server runs it in a
background process and talks to it with ``EngineCoreRequest``/``EngineCoreOutput`` messages.

With async scheduling (``SchedulerConfig.async_scheduling``) ``step()`` is pipelined: it
schedules and launches step N+1, then waits for step N's tokens and records them, so the
scheduler, input preparation and output handling of one step run while the device computes
the other. The outputs are the same as one step at a time: a decode whose input token is still
being sampled reads it on the device, a request whose last allowed token is in flight is not
scheduled again, and one that stops on a sampled token (EOS, stop id) had one more token
computed that is thrown away. Each ``step()`` returns the outputs of the step before.

Structured outputs (``octavo.structured_output``): a constrained request waits, outside the
scheduler, until its grammar is compiled on a background thread; then every step it samples in
carries its token bitmask. When that mask needs the token its previous step is still sampling
(async scheduling), the step's forward pass is launched at once and its sampling later
(``Executor.sample_tokens``): once the previous step is recorded, the grammar work — on a
thread, or in a process of its own (``octavo.structured_output.process``, the default under
async scheduling) — advances the matchers with its tokens and fills the masks while the
outputs go out and the next step is scheduled, and the sampling is launched just before the
next step. The device runs the forward pass while the host records, and the grammar work runs
while the host schedules. With a reasoning parser a constrained request's grammar starts after
its reasoning: a step samples a thinking request without a mask, except under async
scheduling, where its in-flight token may be the end tag, so its mask is deferred like any
other.

With pipeline parallelism up to one step per stage is in flight (vLLM's "virtual engines"): a
new batch enters the first stage while earlier ones are still in later stages, so no stage
idles; a request is in at most one of them (its next step needs the token its last one
samples), and the oldest step is recorded once the pipeline is full or nothing new can run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass

from octavo import envs
from octavo.config import EngineConfig
from octavo.executor import Executor, PendingOutput, create_executor
from octavo.kv_cache.hashing import block_hasher
from octavo.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    GrammarBitmask,
    Request,
    RequestStatus,
    SchedulerOutput,
    SchedulerStats,
)
from octavo.messages.shared_masks import SharedMasks
from octavo.reasoning import get_reasoning_parser
from octavo.scheduler.scheduler import Scheduler
from octavo.structured_output.manager import PendingAccept, StructuredOutputManager
from octavo.structured_output.process import GrammarProcess
from octavo.structured_output.tokenizer import load_grammar_tokenizer

logger = logging.getLogger(__name__)

try:  # per-thread resource usage (Linux); thread_usage counts no switches elsewhere
    import resource

    _RUSAGE_THREAD: int | None = resource.RUSAGE_THREAD
except (ImportError, AttributeError):
    _RUSAGE_THREAD = None


@dataclass(slots=True)
class _InFlightStep:
    """A launched step whose results have not been recorded."""

    scheduler_output: SchedulerOutput
    pending: PendingOutput


@dataclass(slots=True)
class _GrammarTimes:
    """The engine thread's waits for grammar work since start (``SchedulerStats``'
    ``structured_output_*``)."""

    steps: int = 0
    wait_s: float = 0.0
    work_s: float = 0.0

    def add(self, wait_s: float, work_s: float, step: bool) -> None:
        """One wait of ``wait_s`` for ``work_s`` of grammar work; ``step``: a step's sampling
        waited (masks), not only an accept."""
        self.steps += step
        self.wait_s += wait_s
        self.work_s += work_s


@dataclass(slots=True)
class _StepTimes:
    """Where the engine thread's step time went since start (``SchedulerStats``'
    ``engine_*``): scheduling, launching in the executor, waiting for launched steps'
    results, recording them."""

    steps: int = 0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    result_wait_s: float = 0.0
    record_s: float = 0.0


def thread_usage() -> tuple[float, int]:
    """The calling thread's CPU seconds and involuntary context switches (the switches: 0
    where the OS does not count them per thread)."""
    switches = 0
    if _RUSAGE_THREAD is not None:
        with contextlib.suppress(OSError):
            switches = resource.getrusage(_RUSAGE_THREAD).ru_nivcsw
    return time.thread_time(), switches


def make_structured_outputs(config: EngineConfig) -> StructuredOutputManager | GrammarProcess:
    """The engine core's grammars: in a process of their own (``OCTAVO_GRAMMAR_PROCESS``; by
    default under async scheduling, where a step's grammar work runs beside the engine
    thread's Python, whose GIL it would share in process: docs/benchmarks.md) or on the engine
    core's threads. Either fills the masks into ``SharedMasks``, which worker processes map."""
    reasoning = config.model_config.reasoning_parser
    tokenizer_loader = functools.partial(load_grammar_tokenizer, config.model_config)
    in_a_process = envs.grammar_process()
    if in_a_process is None:
        in_a_process = config.scheduler_config.async_scheduling
    if in_a_process:
        return GrammarProcess(tokenizer_loader, config.model_config.vocab_size,
                              max_rows=config.scheduler_config.max_num_seqs,
                              reasoning_parser=reasoning,
                              accept_parallel=envs.grammar_accept() == "parallel")
    return StructuredOutputManager(
        tokenizer_loader, config.model_config.vocab_size,
        reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None,
        shared_masks=SharedMasks.create(config.scheduler_config.max_num_seqs,
                                        config.model_config.vocab_size))


class EngineCore:
    """Owns the scheduler and the executor; one ``step()`` runs one batch."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.structured_outputs = make_structured_outputs(config)
        # The grammars' tokenizer loads (and their process starts) while the model does: a
        # server's first constraint then waits only for its own compilation.
        self.structured_outputs.warm_up()
        try:
            # Worker processes read the grammars' masks in place (SharedMasks).
            self.executor: Executor = create_executor(
                config, shared_masks=self.structured_outputs.shared_masks)
        except BaseException:
            self.structured_outputs.shutdown()
            raise
        swap = config.scheduler_config.preemption_mode == "swap"
        try:
            num_blocks = self.executor.initialize_kv_cache()
            num_host_blocks = self.executor.initialize_swap_space() if swap else 0
        except BaseException:
            self.executor.shutdown()
            self.structured_outputs.shutdown()
            raise
        self.num_blocks = num_blocks
        # Host blocks for swapped-out requests (0 unless --preemption-mode swap).
        self.num_host_blocks = num_host_blocks
        pp_size = config.parallel_config.pipeline_parallel_size
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks=num_blocks,
            max_model_len=config.model_config.max_model_len,
            pipeline_parallel_size=pp_size,
            num_host_blocks=num_host_blocks,
            speculative_config=config.speculative_config,
            max_loras=None if config.lora_config is None else config.lora_config.max_loras,
        )
        self._block_hasher = block_hasher(config.cache_config.block_size)
        # Steps launched and not recorded yet, oldest first, and how many may be.
        self._in_flight: deque[_InFlightStep] = deque()
        # A launched step whose sampling waits for grammar masks: its constrained rows until
        # the step before it is recorded, then the grammar thread's work (the recorded
        # tokens accepted, the masks filled).
        self._deferred_rows: list[str] | None = None
        self._grammar_step: PendingAccept | None = None
        self.max_in_flight = max(pp_size, 2 if config.scheduler_config.async_scheduling else 1)
        # Constrained requests (structured outputs) whose grammar is being compiled.
        self._awaiting_grammar: dict[str, Request] = {}
        # The GIL switch interval while the grammar thread works beside this one, and the one
        # to restore after (see _start_grammar_window); none with the grammars in a process.
        self._grammar_switch_interval = (
            None if isinstance(self.structured_outputs, GrammarProcess)
            else envs.grammar_switch_interval_s())
        self._saved_switch_interval: float | None = None
        self._grammar_times = _GrammarTimes()
        self._step_times = _StepTimes()
        # Prepare a step while the grammars finish the one before (Executor.prepares_ahead).
        self._prepare_ahead = self.executor.prepares_ahead and envs.prepare_ahead()
        spec = config.speculative_config
        if spec is not None:
            logger.info("speculative decoding: %s, up to %d draft tokens per step",
                        spec.method, spec.num_speculative_tokens)
        if pp_size > 1:
            logger.info("pipeline parallelism: up to %d steps in flight", self.max_in_flight)
        elif self.max_in_flight > 1:
            logger.info("async scheduling: the next step is scheduled while one runs")

    @property
    def async_scheduling(self) -> bool:
        """Whether the next step is scheduled while the previous one runs."""
        return self.max_in_flight > 1

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request validated by the front end (``octavo.engine.processor``); a
        constrained one waits for its grammar first."""
        lora = request.lora_request
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_hasher=self._block_hasher if lora is None else block_hasher(
                self.config.cache_config.block_size, lora.lora_int_id),
            arrival_time=request.arrival_time,
            priority=request.priority,
            lora_request=lora,
        )
        if request.beam_search is not None:
            self.scheduler.add_beam_search(core_request, request.beam_search)
            return
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            self.scheduler.add_request(core_request, fork_from=request.fork_from)
            return
        self._awaiting_grammar[request.request_id] = core_request
        self.structured_outputs.submit(request.request_id, constraint,
                                       request.prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._forget_grammars(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """End requests the front end stopped (stop strings): their blocks are freed."""
        self._forget_grammars(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has work: requests to run or waiting for their grammar, or a
        launched step to record."""
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or bool(self._awaiting_grammar))

    def step(self) -> list[EngineCoreOutput]:
        """Run one batch and return what each request produced (with several steps in flight,
        launch the next batch and return what the oldest one produced, once there is one)."""
        failed = self._admit_compiled_grammars()
        if self.max_in_flight > 1:
            return failed + self._step_pipelined()
        times = self._step_times
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        times.schedule_s += time.perf_counter() - start
        if scheduler_output.is_empty:
            if scheduler_output.has_worker_updates:
                # Lets the workers drop state and move blocks (a swap-out).
                self.executor.execute_model(scheduler_output)
            return failed
        try:
            rows, _ = self._constrained_rows(scheduler_output)
            if rows:
                scheduler_output.grammar_bitmask = self._bitmask_now(rows)
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            # One step at a time: the launch and the wait are one call; counted as the wait.
            times.result_wait_s += time.perf_counter() - start
            times.steps += 1
        except BaseException:
            # KeyboardInterrupt or a failed forward: the step's KV writes cannot be trusted.
            self.scheduler.discard_steps([scheduler_output])
            raise
        return failed + self._timed_record(scheduler_output, runner_output)

    def _timed_record(self, scheduler_output: SchedulerOutput, runner_output,
                      deferred_rows: list[str] | None = None) -> list[EngineCoreOutput]:
        """``_record``, its time counted (``SchedulerStats.engine_record_s``)."""
        start = time.perf_counter()
        outputs = self._record(scheduler_output, runner_output, deferred_rows)
        self._step_times.record_s += time.perf_counter() - start
        return outputs

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        times = self._step_times
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        times.schedule_s += time.perf_counter() - start
        launched = False
        refused: dict[str, str] = {}
        try:
            if not scheduler_output.is_empty:
                ahead = self._prepare_ahead and self._grammar_step is not None
                if ahead:
                    # This step is prepared while the grammars finish the step before
                    # (the executor launches it after that sampling), unless its rows'
                    # masks are wanted now. The reasoning gates' phases are not read: that
                    # work updates them.
                    rows, deferred = self._constrained_rows(scheduler_output,
                                                            phases_known=False)
                    ahead = deferred or not rows
                if not ahead:
                    # The deferred step's sampling first: this step's forward pass may read
                    # the tokens it samples, and no matcher is used while the grammars work.
                    refused = self._launch_deferred_sampling()
                    rows, deferred = self._constrained_rows(scheduler_output)
                if rows and not deferred:
                    scheduler_output.grammar_bitmask = self._bitmask_now(rows)
                scheduler_output.sampling_deferred = deferred
                start = time.perf_counter()
                pending = self.executor.execute_model_async(scheduler_output)
                times.launch_s += time.perf_counter() - start
                times.steps += 1
                self._in_flight.append(_InFlightStep(scheduler_output, pending))
                launched = True
                if ahead:
                    refused = self._launch_deferred_sampling()
                if deferred:
                    self._deferred_rows = rows
            elif scheduler_output.has_worker_updates:
                # Lets the workers drop state and move blocks (a swap-out).
                refused = self._launch_deferred_sampling()
                self.executor.execute_model(scheduler_output)
            outputs = self._end_refused(refused)
            if not self._in_flight or (launched and len(self._in_flight) < self.max_in_flight):
                return outputs  # the pipeline is still filling
            oldest = self._in_flight[0]
            # When nothing was launched, the oldest step may be the deferred one.
            outputs += self._end_refused(self._launch_deferred_sampling())
            start = time.perf_counter()
            runner_output = oldest.pending.result()
            times.result_wait_s += time.perf_counter() - start
            self._in_flight.popleft()
            deferred_rows, self._deferred_rows = self._deferred_rows, None
            outputs += self._timed_record(oldest.scheduler_output, runner_output, deferred_rows)
            if not self.scheduler.has_unfinished_requests():
                # Every request is done: the caller may not step again for a while (an
                # in-process LLM returns), so the process keeps Python's own switch interval
                # while idle, even with the grammar step of the step still in flight pending.
                self._end_grammar_window()
        except BaseException:
            # The steps not recorded cannot be trusted (KV writes, tokens in flight).
            unrecorded = [step.scheduler_output for step in self._in_flight]
            if not launched:
                unrecorded.append(scheduler_output)
            self._in_flight.clear()
            self._drop_deferred_sampling()
            self.scheduler.discard_steps(unrecorded)
            self.executor.discard_in_flight()
            raise
        return outputs

    def _launch_deferred_sampling(self) -> dict[str, str]:
        """Wait for the grammar thread (tokens accepted, masks filled) and launch the
        sampling of the step launched with ``sampling_deferred``; the grammar errors of
        requests whose token was refused. Nothing when no step waits."""
        if self._grammar_step is None:
            return {}
        pending, self._grammar_step = self._grammar_step, None
        start = time.perf_counter()
        try:
            accepted = pending.result()
        finally:
            self._end_grammar_window()
        launch = time.perf_counter()
        self._grammar_times.add(launch - start, accepted.work_s, step=True)
        self.executor.sample_tokens(accepted.bitmask)
        self._step_times.launch_s += time.perf_counter() - launch
        return accepted.errors

    def _drop_deferred_sampling(self) -> None:
        pending, self._grammar_step = self._grammar_step, None
        self._deferred_rows = None
        if pending is not None:
            # The matchers are used until it is done; its errors no longer matter (the steps
            # are being discarded after another error).
            with contextlib.suppress(Exception):
                pending.result()
        self._end_grammar_window()

    def _start_grammar_window(self) -> None:
        """Shorten the GIL switch interval while the grammar thread works beside this thread.
        Both run Python: the grammar thread to start (and finish) its step, this one to record
        the step, send the outputs and schedule. CPython hands the GIL to a waiting thread
        only after the holder ran ``sys.getswitchinterval()`` (5 ms) unless the holder blocks,
        so with the default the grammar thread started only once this thread waited for it:
        its work and this thread's ran one after the other (docs/benchmarks.md, sixth
        round)."""
        if self._grammar_switch_interval is None or self._saved_switch_interval is not None:
            return
        self._saved_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self._grammar_switch_interval)

    def _end_grammar_window(self) -> None:
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    # ---- structured outputs ----------------------------------------------------------------

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar compiled to the scheduler; end those whose grammar
        failed. With nothing else to run, wait a little for a compilation instead of
        spinning."""
        manager = self.structured_outputs
        if not self._awaiting_grammar:
            return []
        if not self.scheduler.has_unfinished_requests() and not self._in_flight:
            manager.wait(timeout_s=0.05)
        else:
            # A grammar seen before compiles in microseconds (a copy from the cache): give
            # those a moment, so requests that arrived together start in the same step
            # instead of the late ones waiting a whole step for their own prefill.
            manager.wait(timeout_s=0.002, for_all=True)
        failed = []
        for compiled in manager.take_ready():
            request = self._awaiting_grammar.pop(compiled.request_id, None)
            if request is None:
                continue
            if compiled.error is None:
                self.scheduler.add_request(request)
                continue
            request.status = RequestStatus.FINISHED_ABORTED
            failed.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                           finish_reason=request.status.finish_reason))
        return failed

    def _bitmask_now(self, rows: list[str]) -> GrammarBitmask:
        """The masks of ``rows`` for a step that samples without waiting for a token in
        flight, filled while the engine thread waits (timed as the grammar work too)."""
        start = time.perf_counter()
        bitmask = self.structured_outputs.bitmask(rows)
        elapsed = time.perf_counter() - start
        self._grammar_times.add(elapsed, elapsed, step=True)
        return bitmask

    def _constrained_rows(self, scheduler_output: SchedulerOutput,
                          phases_known: bool = True) -> tuple[list[str], bool]:
        """Constrained requests that sample in this step, and whether any of their masks
        needs a token still in flight (then the step's sampling is deferred).

        ``phases_known=False`` while grammar work is pending, which updates the reasoning
        gates' phases: they are not read, and every constrained request that samples is a row
        (one still thinking gets a mask that lets every token through)."""
        manager = self.structured_outputs
        rows: list[str] = []
        deferred = False
        constrained = manager.constrained_ids
        if not constrained:
            return rows, deferred
        # Only with a reasoning parser may a constrained row need no mask (it thinks).
        gated = manager.gates_reasoning and phases_known
        requests = self.scheduler.requests
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id not in constrained:
                continue
            request = requests[req_id]
            # Scheduling counted the token this step samples as a placeholder; a step that
            # does not sample (a prompt chunk short of the end) added none.
            placeholders = request.num_output_placeholders
            if placeholders == 0 or (request.num_computed_tokens + 1
                                     != len(request.all_token_ids) + placeholders):
                continue
            if gated and not manager.needs_mask(req_id, token_in_flight=placeholders > 1):
                continue  # thinking: its grammar starts after the reasoning
            rows.append(req_id)
            if placeholders > 1:
                deferred = True
        return rows, deferred

    def _record(self, scheduler_output: SchedulerOutput, runner_output,
                deferred_rows: list[str] | None = None) -> list[EngineCoreOutput]:
        """Record a step's results, advancing the grammars of constrained requests; a
        request whose token its grammar refuses is ended (aborted). With ``deferred_rows``
        (the constrained rows of the step launched with ``sampling_deferred``), the grammars
        advance and those rows' masks are filled on the grammar thread while the caller goes
        on: the outputs go out and the next step is scheduled, and the sampling is launched
        (``_launch_deferred_sampling``) just before the next step. That grammar work starts
        from the runner's tokens, before the scheduler records them: it is on the critical
        path of the next sampling, the recording is not."""
        manager = self.structured_outputs
        if deferred_rows is not None:
            # The runner's lists as they are, every request's tokens (the grammars skip those
            # without one; a request speculates only without a grammar, so a constrained row
            # is its one sampled token, as ``update_from_output`` records it). Not copied: the
            # grammars read them before this call returns. ``update_from_output`` drops the
            # tokens of requests finished meanwhile; none of those holds a matcher here: every
            # way a request ends removes its matcher first (abort, stop string, refused token)
            # or when its finishing step is recorded (below).
            self._start_grammar_window()
            self._grammar_step = manager.accept_and_bitmask_async(
                runner_output.req_ids, runner_output.sampled_token_ids, deferred_rows)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        ids = manager.constrained_ids
        if not ids:
            return outputs
        constrained = ([output for output in outputs if output.request_id in ids]
                       if deferred_rows is None else None)
        if constrained:
            sampled = {output.request_id: output.new_token_ids for output in constrained}
            start = time.perf_counter()
            refused = manager.accept_step(sampled)
            elapsed = time.perf_counter() - start
            self._grammar_times.add(elapsed, elapsed, step=False)
            for output in constrained:
                if output.request_id in refused and output.finish_reason is None:
                    self._abort_refused(output.request_id, refused[output.request_id])
                    output.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
        for output in outputs:  # most are not finished: that test first
            if output.finish_reason is not None and output.request_id in ids:
                manager.remove(output.request_id)
        return outputs

    def _end_refused(self, refused: dict[str, str]) -> list[EngineCoreOutput]:
        """End the requests whose sampled token the grammar thread found refused (those
        still running): the outputs saying so."""
        outputs = []
        for request_id, error in refused.items():
            request = self.scheduler.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            self._abort_refused(request_id, error)
            outputs.append(EngineCoreOutput(
                request_id=request_id, new_token_ids=[],
                finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason))
        return outputs

    def _abort_refused(self, request_id: str, error: str) -> None:
        logger.error("request %s: sampled a token its grammar refuses (%s); aborting",
                     request_id, error)
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self.structured_outputs.remove(request_id)

    def _forget_grammars(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._awaiting_grammar.pop(request_id, None)
            self.structured_outputs.remove(request_id)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        times = self._grammar_times
        stats.structured_output_steps = times.steps
        stats.structured_output_wait_s = times.wait_s
        stats.structured_output_work_s = times.work_s
        steps = self._step_times
        stats.engine_steps = steps.steps
        stats.engine_schedule_s = steps.schedule_s
        stats.engine_launch_s = steps.launch_s
        stats.engine_result_wait_s = steps.result_wait_s
        stats.engine_record_s = steps.record_s
        # stats() runs on the engine core's thread (its loop, or LLMEngine's caller).
        stats.engine_thread_cpu_s, stats.engine_thread_involuntary_switches = thread_usage()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so the next requests compute their prompts
        whole (a benchmark that runs the same prompts twice starts each run alike). Only
        while no request holds blocks: False, and nothing forgotten, otherwise."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        try:
            self._launch_deferred_sampling()
            while self._in_flight:  # let the devices finish before tearing down
                self._in_flight.popleft().pending.result()
        finally:
            self.structured_outputs.shutdown()
            self.executor.shutdown()
