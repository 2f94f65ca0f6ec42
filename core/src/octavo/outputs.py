"""What the engine hands back to users: ``RequestOutput`` with ``CompletionOutput``s."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position."""

    # Natural-log probability under the model's raw distribution.
    logprob: float
    # 1 = the most likely token at that position.
    rank: int | None = None
    # Detokenized token text.
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (``n`` of them per request)."""

    # Index among the request's n completions.
    index: int
    # Generated text (stop strings excluded unless include_stop_str_in_output).
    text: str
    # Generated token ids (a matched stop token id included).
    token_ids: list[int]
    # Sum of the sampled tokens' logprobs (None unless logprobs were requested).
    cumulative_logprob: float | None = None
    # Per generated token, when logprobs were requested.
    logprobs: list[PositionLogprobs] | None = None
    # "stop", "length" or "abort" once finished.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, None for EOS/length.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request (time.time() seconds)."""

    # When the request arrived.
    arrival_time: float
    # When the scheduler first scheduled it (the end of its time in the queue).
    first_scheduled_time: float | None = None
    # When its first token was produced.
    first_token_time: float | None = None
    # When it finished.
    finished_time: float | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its completions so far (or final)."""

    # The request id.
    request_id: str
    # The prompt text (None when token ids were given).
    prompt: str | None
    # The tokenized prompt.
    prompt_token_ids: list[int]
    # Logprobs of each prompt token (None for the first), when prompt_logprobs was set.
    prompt_logprobs: list[PositionLogprobs | None] | None
    # One per completion, ordered by index.
    outputs: list[CompletionOutput]
    # True when every completion has finished.
    finished: bool
    # Timings.
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))


@dataclass(slots=True)
class BeamSearchSequence:
    """One sequence a beam search returns (vLLM's shape)."""

    # The prompt's token ids followed by the generated ones.
    tokens: list[int]
    # Per generated token: its id -> Logprob (the chosen token only).
    logprobs: list[PositionLogprobs]
    # Sum of the generated tokens' logprobs (the score is this / generated length **
    # length_penalty).
    cum_logprob: float
    # The text of ``tokens`` (prompt and generated).
    text: str
    # "stop" (ended by EOS) or "length".
    finish_reason: str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The result of one prompt's beam search: ``beam_width`` sequences, best score first."""

    sequences: list[BeamSearchSequence]
