"""Which requests speculate: the rule shared by the scheduler's proposers (ngram) and the
worker's (draft model)."""

from __future__ import annotations

from octavo.sampling_params import SamplingParams


def params_may_speculate(params: SamplingParams) -> bool:
    """Whether a request with these sampling settings gets drafts.

    Not constrained requests (a grammar mask per draft position is not built), seeded
    requests (their tokens must depend only on seed and position, and the accept/reject draws
    would change them) and requests with logits processors (which may keep state per sampled
    token). Beams are excluded by the caller (the scheduler chooses their tokens).
    """
    return (params.structured_outputs is None and params.seed is None
            and not params.logits_processors)
