"""``ModelRunnerOutput``: what a worker returns for one ``SchedulerOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.messages.logprobs import LogprobsLists


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request, in the step's order."""

    # Request ids in the order of the step.
    req_ids: list[str] = field(default_factory=list)
    # Sampled token ids per request: [] for a prefill chunk that does not end the prompt;
    # with speculative decoding the accepted drafts and the target's next token.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Logprobs of the sampled tokens per request id (one row per token), for requests that
    # asked.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Prompt logprobs of the positions computed this step, per request id that asked.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding with a draft model: the draft tokens proposed after this step, per
    # request id that got any (the next step verifies them; vLLM's spec_token_ids).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
