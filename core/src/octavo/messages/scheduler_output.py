"""``SchedulerOutput``: what the scheduler tells the workers to run in one step.

Send only what changed: a request's prompt and sampling settings travel once (when it is first
scheduled or resumed after preemption); after that only its new blocks and progress do. The
worker keeps its own per-request state and drops it when the id appears in
``finished_req_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.lora_request import LoRARequest
from octavo.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has no state for: first scheduling, or resumption after preemption."""

    # Request id (a child id for n > 1).
    req_id: str
    # The prompt.
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty for a fresh request); recomputed as prompt.
    output_token_ids: list[int]
    # How to sample (this completion's own settings: its seed is the effective one).
    sampling_params: SamplingParams
    # All its KV blocks so far, in order (prefix-cache hits first).
    block_ids: list[int]
    # Tokens already in the cache (prefix-cache hits, tokens kept across a swap, or a
    # forked beam's parent's tokens).
    num_computed_tokens: int
    # The scheduler chooses this request's tokens (a beam of a beam search): the worker never
    # appends what it samples; new tokens come in CachedRequestData.new_token_ids.
    tokens_from_scheduler: bool = False
    # Its LoRA adapter (None: the base model).
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class CachedRequestData:
    """The requests the worker already knows, continuing (decode or next prefill chunk).

    One message of parallel lists for all of them (vLLM's shape), not an object per request: a
    step of 256 decodes then costs two list appends per request to build, and the rare
    per-request changes (new blocks, copies-on-write, tokens from the scheduler) are keyed by
    request id, holding only the requests that have one.
    """

    # Request ids, in step order.
    req_ids: list[str] = field(default_factory=list)
    # Tokens in the cache before this step (parallel to req_ids).
    num_computed_tokens: list[int] = field(default_factory=list)
    # Blocks added since the last step, by request id (only requests that got some).
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Tokens generated since the request was last scheduled, by request id (only non-empty
    # ones). Only under pipeline parallelism, where no stage but the last sees the sampled
    # tokens, and for beams (whose tokens the scheduler chooses: see
    # NewRequestData.tokens_from_scheduler); otherwise every rank keeps the tokens it sampled
    # itself and this stays empty.
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Blocks replaced by copy-on-write this step, by request id: (index in the request's block
    # list, new block id). The copy itself is in SchedulerOutput.blocks_to_copy.
    replaced_block_ids: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.req_ids)

    def add(self, req_id: str, num_computed_tokens: int, new_block_ids: list[int] | None = None,
            new_token_ids: list[int] | None = None) -> None:
        """Append one request (its new blocks and tokens when it has some)."""
        self.req_ids.append(req_id)
        self.num_computed_tokens.append(num_computed_tokens)
        if new_block_ids:
            self.new_block_ids[req_id] = new_block_ids
        if new_token_ids:
            self.new_token_ids[req_id] = new_token_ids


@dataclass(slots=True)
class ForkedRequestData:
    """A completion forked from another request in this step (n > 1, best_of): it shares the
    parent's KV blocks and samples its first token from the parent's last logits of this step
    (the step that completes the parent's prompt). It computes no token itself this step."""

    # Request id.
    req_id: str
    # The request it forks (scheduled in this step; its prompt is this one's).
    parent_req_id: str
    # How to sample (this completion's own settings: its own seed).
    sampling_params: SamplingParams
    # Its KV blocks: the parent's, shared.
    block_ids: list[int]
    # Tokens in the cache once this step has run (the parent's prompt).
    num_computed_tokens: int


@dataclass(slots=True)
class GrammarBitmask:
    """Which tokens each constrained request of a step may sample (structured outputs).

    Row ``i`` belongs to ``req_ids[i]``; bit ``t % 32`` of its int32 word ``t // 32`` is set
    when token ``t`` is allowed. ``data`` holds the rows as little-endian int32,
    ``len(req_ids) * num_words`` of them, as a view the runner reads without a copy: of the
    grammar manager's buffer in process, of the received message (read-only) once decoded in
    a worker process (msgpack ``bin``, decoded without a copy: ~1.5 MB a step for 256 rows of
    a 49k vocabulary). ``shared_buffer`` names the buffer of ``SharedMasks``
    (``octavo.messages.shared_masks``) that holds the rows from its first row, when they are
    there: a message to a process mapping those buffers may then leave ``data`` empty.
    """

    req_ids: list[str]
    num_words: int
    data: memoryview
    shared_buffer: int | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work."""

    # Requests new to the worker.
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # Requests the worker already holds (one message for all of them).
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # New tokens to run per request id (the step's order is new requests, then cached ones).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Sum of num_scheduled_tokens.
    total_num_scheduled_tokens: int = 0
    # Requests finished, aborted or preempted since the last step: drop their worker state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Token masks of the constrained requests that sample in this step (None: no such row).
    grammar_bitmask: GrammarBitmask | None = None
    # The masks depend on a token still in flight: the step's forward pass runs now and its
    # sampling waits for ``Executor.sample_tokens`` (async scheduling with structured outputs).
    sampling_deferred: bool = False
    # Requests forked this step (they sample from their parent's row; no tokens of their own).
    forked_reqs: list[ForkedRequestData] = field(default_factory=list)
    # KV block moves the workers make before this step's forward, in this order: device ->
    # host (requests preempted by swapping), device -> device (copy-on-write of shared blocks),
    # host -> device (swapped requests resumed). (source block id, destination block id).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the draft tokens each request verifies this step (vLLM's name).
    # Such a request's num_scheduled_tokens is 1 + len(drafts): its last token, then the
    # drafts; it gets logits at all of them and returns 1 .. len(drafts) + 1 tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """No token to compute (there may still be worker updates: see has_worker_updates)."""
        return self.total_num_scheduled_tokens == 0

    @property
    def has_worker_updates(self) -> bool:
        """Whether the workers must see this step even when it computes nothing: state to drop
        or KV blocks to move."""
        return bool(self.finished_req_ids or self.blocks_to_swap_out or self.blocks_to_copy
                    or self.blocks_to_swap_in)

    def num_computed_before(self, req_id: str) -> int:
        """Tokens a scheduled request had in the cache before this step (a linear search:
        for the rare per-request lookups, e.g. prompt logprobs)."""
        for data in (*self.scheduled_new_reqs, *self.forked_reqs):
            if data.req_id == req_id:
                return data.num_computed_tokens
        cached = self.scheduled_cached_reqs
        if req_id in cached.req_ids:
            return cached.num_computed_tokens[cached.req_ids.index(req_id)]
        raise KeyError(f"request {req_id!r} is not in this step")
