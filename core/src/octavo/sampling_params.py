"""``SamplingParams``: how to sample one request's completion(s), validated on construction."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

from octavo.errors import InvalidRequestError, InvalidRequestTypeError

_GREEDY_EPS = 1e-5
# Every integer field fits a signed 64-bit integer (what msgpack and torch carry); larger values
# are refused here, never left to fail deep inside the engine.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# Longest constraint text (a JSON schema, regex, grammar or all choices together) a request
# may carry: compiling a grammar costs time and memory in proportion to it.
MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
# Most alternatives a ``choice`` constraint may list.
MAX_CHOICES = 1024


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the text a request generates (vLLM's ``StructuredOutputsParams``).

    Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (EBNF, GBNF dialect) or
    ``json_object=True`` (any JSON object) must be set. The engine compiles it with a grammar
    library and masks every token that cannot continue a valid output. Errors raise
    ``InvalidRequestError`` with ``param`` naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON outputs without whitespace between tokens (compact, and fewer tokens).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_fields = [name for name in self.kinds() if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            found = ", ".join(set_fields) if set_fields else "none"
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or "
                f"json_object (got {found})", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestTypeError(
                f"structured_outputs.json must be a JSON schema (object or string), got "
                f"{type(self.json).__name__}", param="structured_outputs.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestTypeError(
                    f"structured_outputs.{name} must be a non-empty string",
                    param=f"structured_outputs.{name}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise InvalidRequestTypeError(
                    "structured_outputs.choice must be a non-empty list of strings",
                    param="structured_outputs.choice")
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(
                    f"structured_outputs.choice may list at most {MAX_CHOICES} strings, got "
                    f"{len(self.choice)}", param="structured_outputs.choice")
            self.choice = list(self.choice)
        kind, text = self.key()
        if len(text) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise InvalidRequestError(
                f"structured_outputs.{kind} is {len(text)} characters; at most "
                f"{MAX_STRUCTURED_OUTPUT_CHARS} are accepted", param=f"structured_outputs.{kind}")

    @staticmethod
    def kinds() -> tuple[str, ...]:
        return ("json", "regex", "choice", "grammar", "json_object")

    def key(self) -> tuple[str, str]:
        """``(kind, text)``: what the grammar is compiled from, and its cache key."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(
                self.json, sort_keys=True, separators=(",", ":"))
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice, separators=(",", ":"))
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass(slots=True)
class LogitsProcessorSpec:
    """A logits processor a request selects (``SamplingParams.logits_processors``): the name a
    plugin registered it under (``octavo_register_logits_processors``) and its keyword
    arguments for this request. The engine checks both at admission."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request; every field is checked in ``__post_init__``.

    Invalid values raise ``octavo.errors.InvalidRequestError`` (a ``ValueError``; an
    ``InvalidRequestTypeError``, also a ``TypeError``, for a wrong type) whose ``param`` is the
    field and whose message gives the value and the valid range.
    """

    # Number of completions returned for the prompt; they share the prompt's KV blocks.
    n: int = 1
    # 0 means greedy; higher flattens the distribution.
    temperature: float = 1.0
    # Keep the k most likely tokens; -1 (or 0) keeps all.
    top_k: int = -1
    # Keep the smallest set of tokens whose probability adds up to top_p; 1.0 keeps all.
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely one's; 0 disables.
    min_p: float = 0.0
    # OpenAI-style penalties in [-2, 2], subtracted per generated occurrence / once per token.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF/CTRL-style multiplicative penalty on tokens in prompt or output; 1.0 disables.
    repetition_penalty: float = 1.0
    # Added to the logits of the given token ids before sampling.
    logit_bias: dict[int, float] | None = None
    # Per-request seed: the same seed gives the same tokens whatever else is in the batch.
    seed: int | None = None
    # Most tokens to generate (None: up to max_model_len).
    max_tokens: int | None = 16
    # Tokens generated before EOS / stop_token_ids may end the request.
    min_tokens: int = 0
    # Strings that end the completion; the matched string is excluded from the text.
    stop: list[str] | str | None = None
    # Token ids that end the completion (kept in token_ids, excluded from text if special).
    stop_token_ids: list[int] | None = None
    # Keep generating past the EOS token.
    ignore_eos: bool = False
    # Keep a matched stop string in the returned text.
    include_stop_str_in_output: bool = False
    # Number of top logprobs returned per generated token (None: none; 0: the sampled one only).
    logprobs: int | None = None
    # Same as logprobs, for every prompt token after the first.
    prompt_logprobs: int | None = None
    # Drop special tokens from the returned text.
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (None: unconstrained).
    structured_outputs: StructuredOutputsParams | None = None
    # Generate best_of completions and return the n with the highest cumulative logprob
    # (None: n). They share the prompt's KV blocks like n > 1 does.
    best_of: int | None = None
    # Words never generated: the token sequence of each (with and without a leading space)
    # cannot be completed; its last token is masked when the output ends with the others.
    bad_words: list[str] | None = None
    # Only these token ids may be generated (None: any).
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (-1: the last max_model_len); None keeps all.
    truncate_prompt_tokens: int | None = None
    # Logits processors registered by plugins, by name (a string, a LogitsProcessorSpec or a
    # {"name"/"qualname": ..., "kwargs": {...}} dict), applied in this order.
    logits_processors: list[LogitsProcessorSpec] | None = None
    # Filled in by the engine: EOS token ids of the model (not user-settable).
    all_stop_token_ids: set[int] = field(default_factory=set)
    # Filled in by the engine: the token sequences of bad_words (not user-settable).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.logits_processors is not None:
            self.logits_processors = _logits_processor_specs(self.logits_processors)
        self._validate()
        self._validate_additions()

    def _validate(self) -> None:
        _check_int("n", self.n, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p must be in (0, 1], got 0.0", param="top_p")
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0.0:
            raise InvalidRequestError("repetition_penalty must be > 0, got 0.0",
                                      param="repetition_penalty")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if self.seed is not None:
            _check_int("seed", self.seed, low=_INT64_MIN)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(
                    f"stop must be a list of non-empty strings, got {s!r}", param="stop")
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid, low=0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestTypeError(
                    f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}",
                    param="logit_bias")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    token_id = int(key)
                except (TypeError, ValueError):
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                    ) from None
                if token_id < 0:
                    raise InvalidRequestError(
                        f"logit_bias token ids must be >= 0, got {key!r}", param="logit_bias")
                _check_float("logit_bias", value, low=-100.0, high=100.0)
                bias[token_id] = float(value)
            self.logit_bias = bias
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestTypeError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}", param="structured_outputs")

    def _validate_additions(self) -> None:
        """Checks of best_of, bad_words, allowed_token_ids, truncate_prompt_tokens."""
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=1)
            if self.best_of < self.n:
                raise InvalidRequestError(
                    f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise InvalidRequestTypeError(
                    f"bad_words must be a list of non-empty strings, got {self.bad_words!r}",
                    param="bad_words")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise InvalidRequestError(
                    "allowed_token_ids must be a non-empty list of token ids, got "
                    f"{self.allowed_token_ids!r}", param="allowed_token_ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for tid in self.allowed_token_ids:
                _check_int("allowed_token_ids", tid, low=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise InvalidRequestError(
                    "truncate_prompt_tokens must be >= 1 (or -1 for max_model_len), got 0",
                    param="truncate_prompt_tokens")

    @property
    def num_completions(self) -> int:
        """Completions generated for the request: best_of if set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_output_token_ids(self) -> bool:
        """True when sampling a token needs every earlier generated token id on the host:
        penalties, bad words of several tokens, logits processors."""
        return (
            self.uses_penalties
            or bool(self.logits_processors)
            or any(len(ids) > 1 for ids in self.bad_words_token_ids or [])
        )

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, frequency or presence penalty is set (the sampler then
        needs every generated token id)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits before the choice and no logprobs:
        the argmax of the raw logits is the whole sampler."""
        return self.is_greedy_after_grammar and self.structured_outputs is None

    @property
    def is_greedy_after_grammar(self) -> bool:
        """Greedy with nothing but a grammar (structured outputs) changing the logits before
        the choice, and no logprobs: the argmax of the grammar-masked logits is the whole
        sampler."""
        return (
            self.greedy
            and not self.uses_penalties
            and not self.logit_bias
            and self.min_tokens == 0
            and self.logprobs is None
            and not self.bad_words
            and self.allowed_token_ids is None
            and not self.logits_processors
        )

    @property
    def max_token_id(self) -> int:
        """Largest token id this request names anywhere (for vocab checks), or -1."""
        ids = list(self.stop_token_ids) + list((self.logit_bias or {}).keys())
        return max(ids) if ids else -1


def _logits_processor_specs(items: object) -> list[LogitsProcessorSpec]:
    """``logits_processors`` as specs: names, specs, or ``{"name"|"qualname", "kwargs"}``
    dicts (vLLM's ``LogitsProcessorConstructor`` shape; positional ``args`` are refused)."""
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestTypeError(
            f"logits_processors must be a list of names, got {items!r}", param="logits_processors")
    specs = []
    for item in items:
        if isinstance(item, LogitsProcessorSpec):
            spec = item
        elif isinstance(item, str):
            spec = LogitsProcessorSpec(item)
        elif isinstance(item, dict):
            unknown = set(item) - {"name", "qualname", "kwargs", "args"}
            name = item.get("name", item.get("qualname"))
            if unknown or not isinstance(name, str):
                raise InvalidRequestError(
                    "a logits processor is a name or {\"qualname\": NAME, \"kwargs\": {...}}, got "
                    f"{item!r}", param="logits_processors")
            if item.get("args"):
                raise InvalidRequestError(
                    f"logits processor {name!r}: positional args are not supported; pass "
                    "kwargs", param="logits_processors")
            kwargs = item.get("kwargs") or {}
            if not isinstance(kwargs, dict):
                raise InvalidRequestTypeError(
                    f"logits processor {name!r}: kwargs must be an object, got {kwargs!r}",
                    param="logits_processors")
            spec = LogitsProcessorSpec(name, dict(kwargs))
        else:
            raise InvalidRequestTypeError(
                f"logits_processors must list names, got {item!r}", param="logits_processors")
        if not spec.name:
            raise InvalidRequestError("a logits processor name must not be empty",
                                      param="logits_processors")
        specs.append(spec)
    return specs


@dataclass(slots=True)
class BeamSearchParams:
    """Settings of a beam search (``LLM.beam_search``; ``use_beam_search`` on the server).

    The engine keeps ``beam_width`` sequences, forking their KV blocks, and scores finished
    ones as Hugging Face transformers' ``num_beams`` does: cumulative logprob divided by
    ``generated_length ** length_penalty``. ``early_stopping`` is transformers': ``True``
    stops once ``beam_width`` sequences finished, ``False`` when no running beam can still beat
    the worst finished one at its current length, ``"never"`` at the best length it could
    reach. Only ``temperature=0`` (deterministic) beam search is supported.
    """

    # Beams kept, and sequences returned.
    beam_width: int
    # Most tokens generated per sequence.
    max_tokens: int
    # Keep extending beams past the EOS token.
    ignore_eos: bool = False
    # Only 0.0 (vLLM's field; sampling beam search is not supported).
    temperature: float = 0.0
    # Exponent of the length normalisation of finished sequences' scores.
    length_penalty: float = 1.0
    # Accepted for vLLM compatibility (beam search has no stop strings).
    include_stop_str_in_output: bool = False
    # When the search stops (see the class docstring).
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        if self.temperature != 0.0:
            raise InvalidRequestError(
                f"beam search is deterministic: temperature must be 0, got {self.temperature}",
                param="temperature")
        _check_float("length_penalty", self.length_penalty)
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(
                f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}",
                param="early_stopping")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestTypeError(f"{name} must be an integer, got {value!r}", param=name)
    _check_range(name, value, low, high)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise InvalidRequestError(
            f"{name} must fit in a signed 64-bit integer (at most {_INT64_MAX}), got {value!r}",
            param=name)


def _check_float(name: str, value: object, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestTypeError(f"{name} must be a number, got {value!r}", param=name)
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    _check_range(name, value, low, high)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and high is not None and not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value!r}", param=name)
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value!r}", param=name)
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value!r}", param=name)
