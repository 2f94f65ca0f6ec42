"""Messages between the front end (tokenizer, detokenizer) and the engine core.

``msgspec.Struct`` so they can cross a process boundary as msgpack (never pickle) when the core
runs in its own process; in process they are passed as they are.
"""

from __future__ import annotations

import msgspec

from octavo.lora_request import LoRARequest
from octavo.messages.logprobs import LogprobsLists
from octavo.sampling_params import BeamSearchParams, SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """One completion to generate (for n > 1 the front end sends n of them)."""

    # Unique id (for n > 1: see octavo.engine.processor.child_request_id).
    request_id: str
    # Tokenized prompt.
    prompt_token_ids: list[int]
    # This completion's own settings, resolved by the front end: all_stop_token_ids holds the
    # model's EOS ids, max_tokens is clipped to the room left in max_model_len, seed is the
    # completion's effective seed, n is 1.
    sampling_params: SamplingParams
    # time.time() when the front end received the request.
    arrival_time: float = 0.0
    # Scheduling priority (--scheduling-policy priority): lower is served first.
    priority: int = 0
    # For completions 1.. of an n > 1 (or best_of) request: the id of its first completion,
    # whose prompt blocks this one shares (forked when that one's prompt is computed).
    fork_from: str | None = None
    # A beam search instead of sampling (sampling_params then hold the beams' greedy logprob
    # settings); the outputs come once, as beam_sequences.
    beam_search: BeamSearchParams | None = None
    # The LoRA adapter it runs with (None: the base model); checked by the front end.
    lora_request: LoRARequest | None = None
    # Which front end (API server process, --api-server-count) sent it: its outputs go back to
    # that one only. Set by EngineCoreClient; 0 with one front end.
    client_index: int = 0


class BeamSequence(msgspec.Struct, kw_only=True):
    """One finished sequence of a beam search."""

    # Generated token ids (the EOS that ended it included).
    token_ids: list[int]
    # Sum of the logprobs of token_ids.
    cumulative_logprob: float
    # Logprob of each token of token_ids.
    logprobs: list[float]
    # "stop" (ended by EOS) or "length".
    finish_reason: str


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request."""

    # Request id.
    request_id: str
    # Tokens sampled this step (0 or 1; up to 1 + num_speculative_tokens with speculation).
    new_token_ids: list[int]
    # "stop", "length" or "abort" once finished, else None.
    finish_reason: str | None = None
    # The stop token id that ended it (None for EOS or length).
    stop_reason: int | str | None = None
    # Logprobs of new_token_ids when requested.
    new_logprobs: LogprobsLists | None = None
    # Prompt logprobs of the prompt positions computed this step (chunked prefill sends parts).
    new_prompt_logprobs: LogprobsLists | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # time.time() when the scheduler first scheduled the request (for queue/prefill times).
    first_scheduled_time: float | None = None
    # A finished beam search: its best sequences, best first (new_token_ids is then empty).
    beam_sequences: list[BeamSequence] | None = None


# ---- the engine-core process protocol ---------------------------------------------------------
# When the core runs in its own process (``AsyncLLM``), the front end and the core exchange the
# tagged structs below as msgpack over two zmq PUSH/PULL sockets: front end -> core carries
# ``EngineCoreInput``, core -> front end carries ``EngineCoreEvent``.


class EngineCoreAdd(msgspec.Struct, tag="add", kw_only=True):
    """Queue requests (the n completions of one user request travel together)."""

    # The completions to queue; the core rejects each one that cannot run (see ``rejected``).
    requests: list[EngineCoreRequest]


class EngineCoreAbort(msgspec.Struct, tag="abort", kw_only=True):
    """End requests now and free their KV blocks."""

    # Child request ids (as in ``EngineCoreRequest.request_id``); unknown ids are ignored.
    request_ids: list[str]
    # True: the front end found a stop string (status "stop"); False: an abort.
    stopped: bool = False


class EngineCoreUtility(msgspec.Struct, tag="utility", kw_only=True):
    """Call one whitelisted method of the core and send back an ``EngineCoreUtilityResult``."""

    # Matches the result to the call.
    call_id: int
    # Method name (see ``core_proc.UTILITY_METHODS``).
    method: str
    # The front end that called, which gets the result (see EngineCoreRequest.client_index).
    client_index: int = 0


class EngineCoreShutdown(msgspec.Struct, tag="shutdown"):
    """Stop the loop, release the device and exit 0."""


EngineCoreInput = EngineCoreAdd | EngineCoreAbort | EngineCoreUtility | EngineCoreShutdown


class SchedulerStats(msgspec.Struct, kw_only=True):
    """Scheduler snapshot after a step (for logs, metrics and admission control)."""

    # Requests in the running batch.
    num_running: int
    # Requests waiting (new or preempted).
    num_waiting: int
    # Fraction of KV blocks held by requests, in [0, 1].
    kv_cache_usage: float
    # Prompt tokens looked up in the prefix cache since start.
    prefix_cache_queries: int
    # Of those, tokens found cached.
    prefix_cache_hits: int
    # Preemptions since start.
    num_preemptions: int
    # Tokens (prompt chunks and decodes) of the most recently scheduled step.
    num_batched_tokens: int = 0
    # Of num_preemptions, those that swapped the request's blocks to host memory (the others
    # recomputed it).
    num_preemptions_swap: int = 0
    # Requests swapped out to host memory, waiting to be swapped back in.
    num_swapped: int = 0
    # Fraction of the host KV block pool (--swap-space) in use, in [0, 1].
    host_kv_cache_usage: float = 0.0
    # Speculative decoding, since start (vLLM's spec_decode_* counters): requests' steps that
    # verified drafts, draft tokens verified, drafts accepted, and drafts accepted at each
    # draft position (index 0 = the first draft).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # Structured outputs, since start: steps whose sampling waited for grammar work (the
    # sampled tokens accepted, the masks filled), the engine thread's seconds blocked on it,
    # and that work's own seconds, timed where it ran (the grammar thread or process; the
    # difference is hand-off latency).
    structured_output_steps: int = 0
    structured_output_wait_s: float = 0.0
    structured_output_work_s: float = 0.0
    # The engine core's thread, since start: steps it launched, and its seconds scheduling,
    # launching in the executor (a step, a deferred sampling), waiting for launched steps'
    # results (with one step at a time: running them) and recording them (grammar accepts on
    # this thread included). Beside the grammar counters: where a run's host time went.
    engine_steps: int = 0
    engine_schedule_s: float = 0.0
    engine_launch_s: float = 0.0
    engine_result_wait_s: float = 0.0
    engine_record_s: float = 0.0
    # The engine core's thread, since start: its CPU seconds and the times the OS took its CPU
    # away while it could run (involuntary context switches; 0 where the OS does not count
    # them per thread). Beside the wall seconds above they tell a thread that ran slower on
    # its CPU from one that was descheduled.
    engine_thread_cpu_s: float = 0.0
    engine_thread_involuntary_switches: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queried prompt tokens since start (0 before any query)."""
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @classmethod
    def idle(cls) -> SchedulerStats:
        """The snapshot of an engine that has run nothing yet."""
        return cls(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                   prefix_cache_hits=0, num_preemptions=0)


class EngineCoreReady(msgspec.Struct, tag="ready", kw_only=True):
    """Sent once, when the model is loaded and the KV cache allocated."""

    # Backend that runs the model.
    backend: str
    # Number of KV blocks and tokens per block.
    num_blocks: int
    block_size: int
    # Longest prompt + completion in tokens.
    max_model_len: int
    # The scheduler when ready, from the engine core's thread: the baseline of the counters
    # (the engine thread's CPU time counts start-up's work too) until a step sends its own.
    stats: SchedulerStats | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """What one step (or one batch of inputs while idle) produced."""

    # Per request that produced something this step.
    outputs: list[EngineCoreOutput]
    # The scheduler after the step.
    stats: SchedulerStats
    # Child request ids the core refused to queue, with the reason (a ValueError's message).
    rejected: dict[str, str] = {}


class EngineCoreUtilityResult(msgspec.Struct, tag="utility_result", kw_only=True):
    """Answer to an ``EngineCoreUtility`` call."""

    call_id: int
    # The method's result (msgpack-able), None on error.
    result: dict[str, int | float | str] | None = None
    # Error message when the call failed.
    error: str | None = None


class EngineCoreFailed(msgspec.Struct, tag="failed", kw_only=True):
    """The core hit an error it cannot recover from (at startup or in a step) and exits."""

    # What went wrong (exception type and message).
    message: str


EngineCoreEvent = EngineCoreReady | EngineCoreOutputs | EngineCoreUtilityResult | EngineCoreFailed
