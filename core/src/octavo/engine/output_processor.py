"""Turns ``EngineCoreOutput``s into ``RequestOutput``s: detokenization, stop strings, n > 1,
best_of and beam search results.

Lives in the front-end process and is the front end's one record of live requests: each user
request (a parent) and its ``n`` completions (children, the engine core's requests), with one
``IncrementalDetokenizer`` per completion. A stop string ends a completion here, and its id is
returned so the caller can finish it in the engine core (which frees its KV blocks). It also
counts what the front end's metrics need (``IterationStats``).

Each request chooses how its outputs come (``RequestOutputKind``): whole snapshots every step
(the offline ``LLM``), only what is new every step (streaming), or only the finished request.
A request with ``best_of > n`` and a beam search have an output only when finished, whatever
the kind: their best completions are known only then (``best_of``: the ``n`` completions of
highest cumulative logprob, best first; a beam search: its ``beam_width`` sequences, best
score first).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.processor import ProcessedPrompt
from octavo.engine.stats import FinishedRequestStats, IterationStats
from octavo.messages import EngineCoreOutput, LogprobsLists
from octavo.messages.engine_core import BeamSequence
from octavo.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from octavo.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    """What ``process_outputs`` returns for a request."""

    # Every step that changed it: the whole request so far (token ids, text, logprobs).
    CUMULATIVE = "cumulative"
    # Every step that added something: only the new tokens, text and logprobs. Text that could
    # still be cut by a stop string is held back, so the deltas join up to the final text.
    DELTA = "delta"
    # Once, when every completion has finished: the whole request.
    FINAL_ONLY = "final_only"


@dataclass(slots=True)
class _CompletionState:
    """One completion being built."""

    index: int
    detokenizer: IncrementalDetokenizer
    # time.time() of its latest token (None before the first): for latency metrics.
    last_token_time: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA outputs: tokens (and their logprobs) already handed out, and whether the finish was.
    num_tokens_sent: int = 0
    finish_sent: bool = False


@dataclass(slots=True)
class _RequestState:
    """One user request (all its completions)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: dict[str, _CompletionState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics
    # The user's n and max_tokens, for metrics.
    n: int = 1
    max_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # DELTA outputs: the prompt logprobs go out once, with the first output.
    prompt_logprobs_sent: bool = False
    # best_of > n: the n completions of highest cumulative logprob are returned, at the end.
    best_of: int | None = None
    # A beam search: its completions arrive at the end (EngineCoreOutput.beam_sequences).
    beam_search: bool = False
    # Aborted by the caller (a beam search then has no completions).
    aborted: bool = False
    # The engine-core request ids (the completions', or the beam search's one).
    core_request_ids: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        if self.aborted:
            return True
        if self.beam_search and not self.completions:
            return False
        # A plain loop: this runs for every request every step (a generator costs more).
        for completion in self.completions.values():
            if completion.finish_reason is None:
                return False
        return True

    @property
    def output_only_when_finished(self) -> bool:
        return self.beam_search or (self.best_of is not None and self.best_of > self.n)


@dataclass(slots=True)
class ProcessedOutputs:
    """Result of one batch of engine-core outputs."""

    # Requests that changed, as full snapshots (finished ones included, then forgotten).
    request_outputs: list[RequestOutput]
    # Child request ids ended by a stop string: finish them in the engine core.
    stopped_req_ids: list[str]
    # Metrics of this batch (prompt tokens admitted and aborts since the previous batch too).
    iteration_stats: IterationStats


class OutputProcessor:
    """Tracks live requests of the front end and assembles their outputs.

    ``stream_interval`` (``--stream-interval``, as vLLM's): a DELTA completion's first tokens
    go out at once, later ones only once that many are waiting, or with its finish; its text
    and logprobs wait with them, so the deltas still join up to the whole output. Fewer,
    larger deltas mean fewer stream writes per token in the server.
    """

    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}
        # Counted since the last process_outputs, reported with its stats.
        self._pending_prompt_tokens = 0
        self._pending_aborts = 0

    def add_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        params = processed.params
        beam_search = processed.beam_search is not None
        best_of = params.best_of if params.best_of is not None and params.best_of > params.n else None
        completions = {}
        for index, core_request in enumerate(processed.core_requests):
            self._child_to_parent[core_request.request_id] = request_id
            if beam_search:
                continue  # its sequences come at the end
            completions[core_request.request_id] = _CompletionState(
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, processed.prompt_token_ids, params,
                    defer=output_kind is RequestOutputKind.FINAL_ONLY or best_of is not None,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=(0.0 if params.logprobs is not None or best_of is not None
                                    else None),
            )
        self._pending_prompt_tokens += len(processed.prompt_token_ids)
        arrival = processed.core_requests[0].arrival_time
        self._requests[request_id] = _RequestState(
            request_id=request_id,
            prompt=processed.prompt,
            prompt_token_ids=processed.prompt_token_ids,
            completions=completions,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=arrival),
            n=processed.beam_search.beam_width if beam_search else params.n,
            max_tokens=params.max_tokens,
            output_kind=output_kind,
            best_of=best_of,
            beam_search=beam_search,
            core_request_ids=[r.request_id for r in processed.core_requests],
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_completions(self) -> int:
        """Completions (engine-core requests) of the unfinished user requests."""
        return len(self._child_to_parent)

    def child_ids(self, request_id: str) -> list[str]:
        """The engine-core ids of an unfinished request's completions ([] if unknown)."""
        state = self._requests.get(request_id)
        return list(state.core_request_ids) if state else []

    def parent_id(self, child_id: str) -> str | None:
        """The user request a completion belongs to (None if unknown or finished)."""
        return self._child_to_parent.get(child_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request; return its final snapshot with finish_reason "abort"."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        state.aborted = True
        for child_id in state.core_request_ids:
            self._child_to_parent.pop(child_id, None)
        for completion in state.completions.values():
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
                self._pending_aborts += 1
        state.metrics.finished_time = time.time()
        return self._snapshot(state)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        changed: dict[str, _RequestState] = {}
        stopped: list[str] = []
        now = time.time()
        stats = IterationStats(
            num_prompt_tokens=self._pending_prompt_tokens,
            finish_reasons=["abort"] * self._pending_aborts,
        )
        self._pending_prompt_tokens = 0
        self._pending_aborts = 0
        # This loop and the next run for every request every step (at 256 requests, the
        # front end's largest share of CPU per streamed token): names used per request are
        # looked up once, outside them.
        child_to_parent = self._child_to_parent
        requests = self._requests
        inter_token_latencies = stats.inter_token_latencies
        num_generation_tokens = 0
        for out in outputs:
            parent_id = child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted or stopped by us while the step ran
            state = requests[parent_id]
            if state.beam_search:
                if out.beam_sequences is not None:
                    self._add_beam_sequences(state, out.beam_sequences, now, stats)
                    if out.first_scheduled_time is not None:
                        state.metrics.first_scheduled_time = out.first_scheduled_time
                    changed[parent_id] = state
                continue
            completion = state.completions[out.request_id]
            if completion.finish_reason is not None:
                continue
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._position_logprobs(out.new_prompt_logprobs))
            metrics = state.metrics
            new_token_ids = out.new_token_ids
            if new_token_ids:
                num_generation_tokens += len(new_token_ids)
                if completion.last_token_time is None:
                    if metrics.first_token_time is None:
                        metrics.first_token_time = now
                    stats.time_to_first_tokens.append(now - metrics.arrival_time)
                else:
                    inter_token_latencies.append(now - completion.last_token_time)
                completion.last_token_time = now
            metrics.num_cached_tokens = out.num_cached_tokens
            if out.first_scheduled_time is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = out.first_scheduled_time
            self._add_tokens(completion, out)
            if out.finish_reason is None and completion.finish_reason == "stop":
                stopped.append(out.request_id)  # stop string: the core must end it too
            changed[parent_id] = state
        stats.num_generation_tokens += num_generation_tokens
        request_outputs = []
        for parent_id, state in changed.items():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                del self._requests[parent_id]
                for child_id in state.core_request_ids:
                    self._child_to_parent.pop(child_id, None)
                stats.finish_reasons.extend(
                    c.finish_reason or "abort" for c in state.completions.values())
                stats.finished_requests.append(_finished_stats(state, now))
            if state.output_only_when_finished:
                if finished:
                    request_outputs.append(self._snapshot(state))
            elif state.output_kind is RequestOutputKind.CUMULATIVE:
                request_outputs.append(self._snapshot(state))
            elif state.output_kind is RequestOutputKind.FINAL_ONLY:
                if finished:
                    request_outputs.append(self._snapshot(state))
            else:
                delta = self._delta(state, finished)
                if delta is not None:
                    request_outputs.append(delta)
        return ProcessedOutputs(request_outputs, stopped, stats)

    def _add_tokens(self, completion: _CompletionState, out: EngineCoreOutput) -> None:
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            if completion.cumulative_logprob is not None:
                # Column 0 is the sampled token's logprob.
                completion.cumulative_logprob += sum(row[0] for row in out.new_logprobs.logprobs)
            if completion.logprobs is not None:
                completion.logprobs.extend(self._position_logprobs(out.new_logprobs))
        finished = out.finish_reason is not None
        stop_string = completion.detokenizer.update(out.new_token_ids, finished)
        if stop_string is not None:
            completion.finish_reason = "stop"
            completion.stop_reason = stop_string
        elif finished:
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason

    def _add_beam_sequences(self, state: _RequestState, sequences: list[BeamSequence],
                            now: float, stats: IterationStats) -> None:
        """A beam search ended: its sequences (best first) become the completions."""
        for index, sequence in enumerate(sequences):
            detokenizer = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                                 _BEAM_TEXT_PARAMS, defer=True)
            detokenizer.update(sequence.token_ids, True)
            positions = [
                {token_id: Logprob(logprob=logprob, decoded_token=self.tokenizer.decode([token_id]))}
                for token_id, logprob in zip(sequence.token_ids, sequence.logprobs)
            ]
            state.completions[f"{state.request_id}#{index}"] = _CompletionState(
                index=index, detokenizer=detokenizer, last_token_time=now,
                token_ids=list(sequence.token_ids), logprobs=positions,
                cumulative_logprob=sequence.cumulative_logprob,
                finish_reason=sequence.finish_reason)
            stats.num_generation_tokens += len(sequence.token_ids)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            stats.time_to_first_tokens.append(now - state.metrics.arrival_time)

    def _position_logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        positions = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            position: PositionLogprobs = {}
            for column, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
                if token_id in position:
                    continue  # the chosen token is also among the top-k
                position[token_id] = Logprob(
                    logprob=logprob,
                    rank=rank if column == 0 else column,
                    decoded_token=self.tokenizer.decode([token_id]),
                )
            positions.append(position)
        return positions

    def _delta(self, state: _RequestState, request_finished: bool) -> RequestOutput | None:
        """What is new in ``state`` since its last delta; None when nothing is.

        :param request_finished: ``state.finished``, as the caller has just computed it.
        """
        deltas = []
        interval = self.stream_interval
        # In index order: add_request (and a beam search's end) insert them so.
        for c in state.completions.values():
            finished = c.finish_reason is not None
            num_tokens = len(c.token_ids)
            if (interval > 1 and not finished and c.num_tokens_sent
                    and num_tokens - c.num_tokens_sent < interval):
                continue  # held: its text stays in the detokenizer until the interval is full
            text = c.detokenizer.take_delta(finished)
            new_token_ids = c.token_ids[c.num_tokens_sent:]
            report_finish = finished and not c.finish_sent
            if not text and not new_token_ids and not report_finish:
                continue
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[c.num_tokens_sent:num_tokens]
            c.num_tokens_sent = num_tokens
            c.finish_sent = finished
            deltas.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=new_token_ids,
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        if not deltas:
            return None
        prompt_logprobs = None
        if not state.prompt_logprobs_sent:
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=deltas,
            finished=request_finished,
            metrics=state.metrics,
        )

    def _snapshot(self, state: _RequestState) -> RequestOutput:
        completions = sorted(state.completions.values(), key=lambda c: c.index)
        if state.best_of is not None and state.finished:
            return self._best_of_snapshot(state, completions)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[
                CompletionOutput(
                    index=c.index,
                    text=c.detokenizer.output_text,
                    token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in completions
            ],
            finished=state.finished,
            metrics=state.metrics,
        )


    def _best_of_snapshot(self, state: _RequestState,
                          completions: list[_CompletionState]) -> RequestOutput:
        """The n completions of highest cumulative logprob, best first, indexed 0..n-1."""
        best = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))[: state.n]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[
                CompletionOutput(
                    index=index,
                    text=c.detokenizer.output_text,
                    token_ids=list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for index, c in enumerate(best)
            ],
            finished=True,
            metrics=state.metrics,
        )


# How beam search sequences are turned into text.
_BEAM_TEXT_PARAMS = SamplingParams(max_tokens=None)


def _finished_stats(state: _RequestState, now: float) -> FinishedRequestStats:
    """The metrics of a request that just finished (missing timestamps count as ``now``)."""
    metrics = state.metrics
    scheduled = metrics.first_scheduled_time or now
    first_token = metrics.first_token_time or now
    generated = [len(c.token_ids) for c in state.completions.values()]
    decode_time = max(now - first_token, 0.0)
    longest = max(generated, default=0)
    return FinishedRequestStats(
        e2e_latency=now - metrics.arrival_time,
        queue_time=max(scheduled - metrics.arrival_time, 0.0),
        prefill_time=max(first_token - scheduled, 0.0),
        decode_time=decode_time,
        inference_time=max(now - scheduled, 0.0),
        time_per_output_token=decode_time / (longest - 1) if longest > 1 else None,
        num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=sum(generated),
        n=state.n,
        max_tokens=state.max_tokens,
    )
