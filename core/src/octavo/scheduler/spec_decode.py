"""The scheduler's side of speculative decoding: which requests get drafts, and the counters
behind the ``spec_decode_*`` metrics (see ``octavo.spec_decode`` for the whole flow)."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.messages import Request


def may_speculate(request: Request) -> bool:
    """Whether drafts are proposed for ``request``.

    Not for beams (the scheduler chooses their tokens), constrained requests (a grammar mask
    per draft position is not built), seeded requests (their tokens must depend only on seed
    and position, and the accept/reject draws would change them) and requests with logits
    processors (which may keep state per sampled token). Those decode one token per step.
    """
    params = request.sampling_params
    return (request.beam_group is None and params.structured_outputs is None
            and params.seed is None and not params.logits_processors)


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
