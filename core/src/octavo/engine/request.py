"""``Request``: the engine core's record of one sequence being generated."""

from __future__ import annotations

import enum
import time

from octavo.kv_cache.hashing import BlockHash, extend_block_hashes
from octavo.sampling_params import SamplingParams

RequestId = str


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ("stop", "length", "abort"), None while running."""
        return self.value if self.is_finished else None


class Request:
    """One sequence: its tokens, progress, blocks' hashes and stopping rules.

    For ``n > 1`` the front end sends one ``Request`` per completion; they share the prompt's
    KV blocks through the prefix cache.
    """

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        block_size: int,
        seed: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Effective max tokens (already clipped to max_model_len by the front end).
        self.max_tokens = max_tokens
        # Effective seed of this completion (None: unseeded).
        self.seed = seed
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
        self.num_preemptions = 0
        # Prompt positions whose logprobs were sent to the front end (kept across preemption,
        # so recomputed positions are not sent twice).
        self.num_prompt_logprobs_sent = 0
        self.stop_reason: int | str | None = None
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size)

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
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need logits of every prompt token, so no cached prefix is used."""
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size)

    def check_stop(self, max_model_len: int) -> bool:
        """Update ``status`` after a new token; True when the request just finished."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
