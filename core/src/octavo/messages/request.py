"""``Request``: the engine core's record of one sequence being generated."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any, NewType

from octavo.lora_request import LoRARequest
from octavo.sampling_params import SamplingParams

# A request's id (for n > 1, one completion's id; see ``octavo.engine.processor``).
RequestId = str
# The prefix-cache key of one full KV block (see ``octavo.kv_cache.hashing``).
BlockHash = NewType("BlockHash", bytes)
# Appends the hashes of the blocks of ``token_ids`` that became full to ``block_hashes``;
# returns the number of tokens at which the next block becomes full (calling it with fewer
# adds nothing), or None (then it is called after every token).
BlockHasher = Callable[[list[BlockHash], list[int]], int | None]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Preempted by swapping: its KV blocks are in host memory.
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        # By value (a str, its hash cached): read for every request every step.
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ("stop", "length", "abort"), None while running."""
        value = self._value_
        return value if value in _FINISHED_VALUES else None


_FINISHED_VALUES = frozenset({"stop", "length", "abort"})


class Request:
    """One sequence: its tokens, progress, blocks' hashes and stopping rules.

    For ``n > 1`` the front end sends one ``Request`` per completion; the others fork the
    first one's prompt blocks (``fork_from``). ``sampling_params`` are the completion's own: its
    ``max_tokens`` is already clipped to the room left in ``max_model_len`` and its ``seed`` is
    the completion's effective seed (see ``octavo.engine.processor``).

    :param block_hasher: keeps ``block_hashes`` up to date as tokens are appended (the KV
        cache's hashing, injected so that this message type depends on no layer above it);
        ``None`` keeps no hashes (no prefix caching).
    """

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if sampling_params.max_tokens is None:
            raise ValueError(f"request {request_id}: sampling_params.max_tokens must be resolved")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose K/V are in the cache once every scheduled step has run (the scheduler
        # advances it when it schedules a step, not when the step's results come back).
        self.num_computed_tokens = 0
        # Tokens sampled by scheduled steps whose results have not come back yet (0 or 1:
        # at most one step is in flight beyond the one being scheduled). Always 0 without
        # async scheduling once a step's results are recorded.
        self.num_output_placeholders = 0
        # Prompt tokens found in the prefix cache at first scheduling.
        self.num_cached_tokens = -1
        # time.time() when the scheduler first scheduled it (None while it has only waited).
        self.first_scheduled_time: float | None = None
        # Tokens the workers know (under pipeline parallelism they learn new ones from the
        # scheduler; see CachedRequestData.new_token_ids).
        self.num_tokens_sent_to_workers = 0
        self.num_preemptions = 0
        # Prompt positions whose logprobs were sent to the front end (kept across preemption,
        # so recomputed positions are not sent twice).
        self.num_prompt_logprobs_sent = 0
        self.stop_reason: int | str | None = None
        # Scheduling priority (lower first under --scheduling-policy priority).
        self.priority = priority
        # Its LoRA adapter (None: the base model); block_hasher keys its blocks by it.
        self.lora_request = lora_request
        # Position in the queues: (priority or 0, arrival time, admission number, beam index);
        # set by the scheduler when the request is added.
        self.sort_key: tuple[float, ...] = ()
        # Completions forked from this one once its prompt is computed (n > 1).
        self.pending_forks: list[Request] = []
        # The workers do not know this request yet although it holds blocks (a forked beam):
        # its next scheduling sends NewRequestData.
        self.new_to_workers = False
        # The beam search this request is a beam of (an
        # octavo.scheduler.beam_search.BeamSearchGroup), None for a sampled request.
        self.beam_group: Any = None
        # Draft tokens proposed to follow all_token_ids (speculative decoding): the next step
        # verifies them; [] when none (see octavo.spec_decode).
        self.spec_token_ids: list[int] = []
        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        # Tokens at which block_hasher may add a hash next (0: at every token).
        self._num_tokens_next_hash = 0
        if block_hasher is not None:
            self._num_tokens_next_hash = block_hasher(self.block_hashes, self.all_token_ids) or 0
        # The sampled tokens that may stop it (EOS unless ignored, stop_token_ids): any other
        # token stops it only by length (see append_token_and_check_stop).
        self._stop_candidates = frozenset(sampling_params.stop_token_ids or ()).union(
            () if sampling_params.ignore_eos else sampling_params.all_stop_token_ids)

    @property
    def max_tokens(self) -> int:
        """Most tokens to generate (the front end clipped it to fit ``max_model_len``)."""
        max_tokens = self.sampling_params.max_tokens
        assert max_tokens is not None, "checked in __init__"
        return max_tokens

    @property
    def seed(self) -> int | None:
        """This completion's effective seed (None: unseeded)."""
        return self.sampling_params.seed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus the ones sampled in flight: where the sequence will be."""
        return len(self.all_token_ids) + self.num_output_placeholders

    def reached_length_limit(self, max_model_len: int) -> bool:
        """Whether the tokens in flight already take it to max_tokens or max_model_len, so
        no further step may be scheduled for it (its last token is being sampled)."""
        return (
            self.num_output_tokens + self.num_output_placeholders >= self.max_tokens
            or self.num_tokens_with_placeholders >= max_model_len
        )

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id (0: none)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need logits of every prompt token, so no cached prefix is used."""
        return self.sampling_params.prompt_logprobs is not None

    def fork(self, request_id: RequestId) -> Request:
        """A new request with this one's tokens, hashes, settings and progress (a beam of a
        beam search forked from its parent); its KV blocks are the caller's to share."""
        child = Request(request_id, self.prompt_token_ids, self.sampling_params,
                        arrival_time=self.arrival_time, priority=self.priority,
                        lora_request=self.lora_request)
        child._block_hasher = self._block_hasher
        child.block_hashes = list(self.block_hashes)
        child._num_tokens_next_hash = self._num_tokens_next_hash
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.status = self.status
        return child

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        if self._block_hasher is not None and len(all_token_ids) >= self._num_tokens_next_hash:
            self._num_tokens_next_hash = self._block_hasher(self.block_hashes, all_token_ids) or 0

    def append_token_and_check_stop(self, token_id: int, max_model_len: int) -> bool:
        """``append_output_token`` then ``check_stop``, in one call made for every running
        request every step: a token that can stop it neither by id nor by length (the common
        case) skips ``check_stop``."""
        output_token_ids = self.output_token_ids
        output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)  # append_output_token, inline
        num_tokens = len(all_token_ids)
        if self._block_hasher is not None and num_tokens >= self._num_tokens_next_hash:
            self._num_tokens_next_hash = self._block_hasher(self.block_hashes, all_token_ids) or 0
        if (token_id not in self._stop_candidates
                and len(output_token_ids) < self.sampling_params.max_tokens
                and num_tokens < max_model_len):
            return False
        return self.check_stop(max_model_len)

    def check_stop(self, max_model_len: int) -> bool:
        """Update ``status`` after a new token; True when the request just finished."""
        # Lengths read directly, not through the properties: this runs for every request
        # every step.
        params = self.sampling_params
        output_token_ids = self.output_token_ids
        num_output_tokens = len(output_token_ids)
        last = output_token_ids[-1]
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if (num_output_tokens >= params.max_tokens
                or len(self.all_token_ids) >= max_model_len):
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
