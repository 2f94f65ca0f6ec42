"""Messages between the front end (tokenizer, detokenizer) and the engine core.

``msgspec.Struct`` so they can cross a process boundary as msgpack (never pickle) when the core
runs in its own process; in process they are passed as they are.
"""

from __future__ import annotations

import msgspec

from octavo.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """One completion to generate (for n > 1 the front end sends n of them)."""

    # Unique id (for n > 1: "<index>_<parent id>").
    request_id: str
    # Tokenized prompt.
    prompt_token_ids: list[int]
    # How to sample; all_stop_token_ids already holds the model's EOS ids.
    sampling_params: SamplingParams
    # Effective max new tokens (already clipped to max_model_len - prompt length).
    max_tokens: int
    # Effective seed of this completion (None: unseeded).
    seed: int | None = None
    # time.time() when the front end received the request.
    arrival_time: float = 0.0


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs of consecutive positions: row i = [chosen token, top-k tokens...]."""

    # [num_positions][1 + k] token ids; column 0 is the chosen (sampled or actual) token.
    token_ids: list[list[int]]
    # [num_positions][1 + k] log-probabilities matching token_ids.
    logprobs: list[list[float]]
    # [num_positions] rank of the chosen token (1 = most likely).
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request."""

    # Request id.
    request_id: str
    # Tokens sampled this step (0 or 1 today).
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
