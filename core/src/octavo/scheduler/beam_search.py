"""Beam search in the engine: the beams of one search, and how each step chooses the next ones.

A beam search is one ``BeamSearchGroup`` in the scheduler. Its beams are ordinary requests that
run greedy steps returning the top-``K`` logprobs of their next token; once every live beam has
reported, ``select`` runs one step of Hugging Face transformers' beam search (its
``_beam_search``, same candidates, same scores, same stopping rules), and the scheduler turns
the chosen continuations into beams: a parent chosen once continues with its new token, one
chosen again is forked (its KV blocks shared, the last partial one copied on write), one not
chosen is dropped.

One step, for ``W = beam_width`` and ``K = max(2, 1 + number of EOS ids) * W``:

1. candidates: every beam's cumulative logprob plus each of its top-K next-token logprobs; the
   K best over all beams, best first;
2. a candidate "hits" when its token is an EOS id (unless ``ignore_eos``) or the sequence
   reaches ``max_tokens``; hits among the W best candidates become finished hypotheses scored
   ``cumulative_logprob / generated_length ** length_penalty`` (the EOS counted), keeping the
   W best ever seen, unless the search cannot improve any more or (``early_stopping=True``)
   already has W;
3. the W best candidates that did not hit are the next beams;
4. the search stops when every candidate hit (max length), or with W finished hypotheses and
   ``early_stopping=True``, or when no running beam can beat the worst of W finished ones:
   the best running beam's cumulative logprob over the current length (``early_stopping`` of
   ``"never"`` and a positive ``length_penalty``: over ``max_tokens``) is not above it.

The result is the finished hypotheses, best score first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.messages import Request
from octavo.messages.engine_core import BeamSequence
from octavo.sampling_params import BeamSearchParams


@dataclass(slots=True)
class BeamHypothesis:
    """A finished sequence of the search."""

    # Generated tokens (the EOS included).
    token_ids: list[int]
    # Logprob of each generated token.
    logprobs: list[float]
    # Their sum.
    cumulative_logprob: float
    # cumulative_logprob / len(token_ids) ** length_penalty.
    score: float
    # "stop" (EOS) or "length".
    finish_reason: str


@dataclass(slots=True)
class Continuation:
    """A chosen next beam: ``parent`` extended by ``token_id``."""

    parent: Request
    token_id: int
    logprob: float
    # The parent's cumulative logprob plus logprob.
    cumulative_logprob: float


@dataclass(slots=True)
class BeamSearchGroup:
    """The live beams of one beam search and what it has found so far."""

    # The request id the front end knows (the beams have their own ids).
    group_id: str
    params: BeamSearchParams
    # EOS ids that end a beam (empty with ignore_eos).
    eos_token_ids: frozenset[int]
    # Most tokens a sequence may generate (max_tokens, clipped to max_model_len).
    max_new_tokens: int
    # Live beams, in the search's order (best first after each step).
    beams: list[Request] = field(default_factory=list)
    # Per live beam id: cumulative logprob and per-token logprobs of its generated tokens.
    cumulative_logprobs: dict[str, float] = field(default_factory=dict)
    token_logprobs: dict[str, list[float]] = field(default_factory=dict)
    # Per beam id that reported this step: its top-K (token, logprob).
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # Finished hypotheses, best first (at most beam_width).
    finished: list[BeamHypothesis] = field(default_factory=list)
    # Tokens every live beam has generated.
    num_generated: int = 0
    # False once no running beam can beat the worst finished hypothesis.
    can_improve: bool = True
    # Beams made so far (for unique beam ids).
    num_beams_made: int = 0
    # The request as queued (its prompt): every (re)start of the search forks its root from it.
    template: Request | None = None
    # The queues' key of the search (priority, arrival, admission); beams add their number.
    sort_key_base: tuple[float, ...] = ()

    @property
    def beam_width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        """K: the candidates kept per step, and the logprobs each beam reports."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    def new_beam_id(self) -> str:
        beam_id = f"{self.group_id}#beam{self.num_beams_made}"
        self.num_beams_made += 1
        return beam_id

    def add_beam(self, beam: Request, cumulative_logprob: float, logprobs: list[float]) -> None:
        beam.beam_group = self
        self.beams.append(beam)
        self.cumulative_logprobs[beam.request_id] = cumulative_logprob
        self.token_logprobs[beam.request_id] = logprobs

    def restart(self) -> None:
        """Forget every beam and hypothesis: the search starts again from its prompt (after a
        preemption by recompute; deterministic, so the result is the same)."""
        self.beams.clear()
        self.cumulative_logprobs.clear()
        self.token_logprobs.clear()
        self.candidates.clear()
        self.finished.clear()
        self.num_generated = 0
        self.can_improve = True

    def record(self, beam: Request, top: list[tuple[int, float]]) -> None:
        """A beam's top-K next tokens and logprobs for this step."""
        self.candidates[beam.request_id] = top

    def has_reported(self, beam: Request) -> bool:
        return beam.request_id in self.candidates

    @property
    def ready(self) -> bool:
        """Every live beam reported its candidates for this step."""
        return bool(self.beams) and all(b.request_id in self.candidates for b in self.beams)

    def select(self) -> list[Continuation] | None:
        """Run one step over the reported candidates; the next beams (best first), or
        ``None`` when the search is over (``finished`` holds the result)."""
        assert self.ready, f"beam search {self.group_id}: not every beam reported"
        width, length_penalty = self.beam_width, self.params.length_penalty
        candidates: list[Continuation] = []
        for beam in self.beams:
            base = self.cumulative_logprobs[beam.request_id]
            for token_id, logprob in self.candidates[beam.request_id]:
                candidates.append(Continuation(beam, token_id, logprob, base + logprob))
        self.candidates.clear()
        candidates.sort(key=lambda c: -c.cumulative_logprob)  # stable: beam, then rank
        top = candidates[: self.num_candidates]
        generated = self.num_generated + 1
        at_max_length = generated >= self.max_new_tokens
        hits = [at_max_length or c.token_id in self.eos_token_ids for c in top]
        full = len(self.finished) == width and self.params.early_stopping is True
        if self.can_improve and not full:
            for rank, (candidate, hit) in enumerate(zip(top, hits)):
                if hit and rank < width:
                    self._add_hypothesis(candidate, generated)
        running = [c for c, hit in zip(top, hits) if not hit][:width]
        self.num_generated = generated
        if running and len(self.finished) == width:
            if self.params.early_stopping == "never" and length_penalty > 0.0:
                best_length = self.max_new_tokens
            else:
                best_length = generated
            best_possible = running[0].cumulative_logprob / best_length ** length_penalty
            worst_finished = min(h.score for h in self.finished)
            self.can_improve = self.can_improve and best_possible > worst_finished
        done = (
            not self.can_improve
            or (len(self.finished) == width and self.params.early_stopping is True)
            or all(hits)
        )
        return None if done else running

    def _add_hypothesis(self, candidate: Continuation, generated: int) -> None:
        parent_id = candidate.parent.request_id
        token_ids = list(candidate.parent.output_token_ids) + [candidate.token_id]
        score = candidate.cumulative_logprob / generated ** self.params.length_penalty
        self.finished.append(BeamHypothesis(
            token_ids=token_ids,
            logprobs=self.token_logprobs[parent_id] + [candidate.logprob],
            cumulative_logprob=candidate.cumulative_logprob,
            score=score,
            finish_reason="stop" if candidate.token_id in self.eos_token_ids else "length",
        ))
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones win ties
        del self.finished[self.beam_width:]

    def result(self) -> list[BeamSequence]:
        """The finished sequences, best first."""
        return [
            BeamSequence(token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob,
                         logprobs=h.logprobs, finish_reason=h.finish_reason)
            for h in self.finished
        ]
