"""Turns a user's prompt and ``SamplingParams`` into validated ``EngineCoreRequest``s."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Union

from octavo.backends.backend import BackendCapabilities
from octavo.backends.capabilities import check_request
from octavo.config import ModelConfig
from octavo.engine.messages import EngineCoreRequest
from octavo.sampling_params import SamplingParams

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = Union[str, list[int], dict[str, Any]]


@dataclasses.dataclass(slots=True)
class ProcessedPrompt:
    """A request ready for the engine core, plus what the output side needs."""

    # The prompt text (None when token ids were given).
    prompt: str | None
    # Tokenized prompt.
    prompt_token_ids: list[int]
    # The params with all_stop_token_ids filled in (a copy of the user's).
    params: SamplingParams
    # One per completion (n of them).
    core_requests: list[EngineCoreRequest]


class Processor:
    """Tokenizes and validates requests; every problem is a ``ValueError`` naming it.

    With ``capabilities`` (those of the selected backend, named ``backend``), a request that
    asks more than the backend supports is refused too
    (``octavo.backends.capabilities.check_request``).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        eos_token_ids: set[int],
        backend: str | None = None,
        capabilities: BackendCapabilities | None = None,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if capabilities is not None and backend is None:
            raise TypeError("Processor: capabilities need the name of their backend (backend=...)")
        self.backend = backend
        self.capabilities = capabilities

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise TypeError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        vocab = self.model_config.vocab_size
        ids = list(token_ids)
        for tid in ids:
            if isinstance(tid, bool) or not isinstance(tid, int):
                raise TypeError(f"prompt token ids must be integers, got {tid!r}")
            if not 0 <= tid < vocab:
                raise ValueError(f"prompt token id {tid} is out of range [0, {vocab})")
        return ids

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> ProcessedPrompt:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if self.capabilities is not None:
            assert self.backend is not None, "checked in __init__"
            check_request(self.backend, self.capabilities, params)
        text, token_ids = self.tokenize(prompt)
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(token_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {max_len}: the "
                "prompt and at least one generated token must fit. Shorten the prompt or raise "
                "max_model_len."
            )
        vocab = self.model_config.vocab_size
        if params.max_token_id >= vocab:
            raise ValueError(
                f"token id {params.max_token_id} in stop_token_ids/logit_bias is out of range "
                f"[0, {vocab})"
            )
        params = dataclasses.replace(params, all_stop_token_ids=set(self.eos_token_ids))
        room = max_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = arrival_time if arrival_time is not None else time.time()
        # Prompt logprobs are the same for every completion: only the first computes them
        # (the others may then reuse its prompt blocks through the prefix cache).
        child_params = params
        if params.n > 1 and params.prompt_logprobs is not None:
            child_params = dataclasses.replace(params, prompt_logprobs=None)
        core_requests = [
            EngineCoreRequest(
                request_id=child_request_id(request_id, i, params.n),
                prompt_token_ids=token_ids,
                sampling_params=params if i == 0 else child_params,
                max_tokens=max_tokens,
                seed=child_seed(params.seed, i, params.n),
                arrival_time=arrival,
            )
            for i in range(params.n)
        ]
        return ProcessedPrompt(text, token_ids, params, core_requests)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_seed(seed: int | None, index: int, n: int) -> int | None:
    """Seed of completion ``index``: the request's seed for n == 1, else one derived from it."""
    if seed is None or n == 1:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
