"""The scheduler's side of speculative decoding: which requests get drafts, and the counters
behind the ``spec_decode_*`` metrics (see ``octavo.spec_decode`` for the whole flow)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from octavo.config import SpeculativeConfig
from octavo.messages import ModelRunnerOutput, Request
from octavo.spec_decode.ngram_proposer import NgramProposer
from octavo.spec_decode.proposals import params_may_speculate


def may_speculate(request: Request) -> bool:
    """Whether drafts are proposed for ``request``: not for beams (the scheduler chooses their
    tokens), nor for what ``params_may_speculate`` rules out (constrained, seeded and
    logits-processor requests). Those decode one token per step.
    """
    return request.beam_group is None and params_may_speculate(request.sampling_params)


class Proposer(Protocol):
    """Where a request's drafts come from, asked by the scheduler once a step's tokens of the
    request are recorded."""

    def propose(self, request: Request, runner_output: ModelRunnerOutput) -> list[int]:
        """Draft tokens to follow ``request.all_token_ids`` ([]: none)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is gone: drop what was kept for it."""
        ...


class NgramSchedulerProposer:
    """``"method": "ngram"``: prompt lookup, computed here in the scheduler."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.num_speculative_tokens)

    def propose(self, request: Request, runner_output: ModelRunnerOutput) -> list[int]:
        return self.ngram.propose(request.all_token_ids, key=request.request_id)

    def forget(self, request_id: str) -> None:
        self.ngram.forget(request_id)


class RunnerProposals:
    """``"method": "draft_model"``: the workers' draft model proposed after the step (it runs
    beside the target; ``ModelRunnerOutput.spec_token_ids``); this only hands them over."""

    def propose(self, request: Request, runner_output: ModelRunnerOutput) -> list[int]:
        return list(runner_output.spec_token_ids.get(request.request_id, ()))

    def forget(self, request_id: str) -> None:
        pass


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The scheduler's proposer for ``config.method``."""
    if config.uses_draft_model:
        return RunnerProposals()
    return NgramSchedulerProposer(config)


@dataclass(slots=True)
class SpecDecodeStats:
    """Draft counters since the engine started (vLLM's ``spec_decode_*`` metrics)."""

    # Request steps that verified at least one draft token.
    num_drafts: int = 0
    # Draft tokens verified.
    num_draft_tokens: int = 0
    # Of those, accepted.
    num_accepted_tokens: int = 0
    # Accepted drafts by position in their draft (index 0: the first draft token).
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's step verified ``num_draft_tokens`` drafts, accepting the first
        ``num_accepted``."""
        assert 0 <= num_accepted <= num_draft_tokens, (num_accepted, num_draft_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1
