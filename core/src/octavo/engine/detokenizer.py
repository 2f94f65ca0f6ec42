"""Incremental detokenization of one completion, with stop strings and streamed deltas.

The output processor makes one ``IncrementalDetokenizer`` per completion and, every step,
calls ``update(new_token_ids, finished)`` then ``take_delta(finished)``.

Two ways to turn tokens into text:

- **stream** (fast tokenizers): ``tokenizers.decoders.DecodeStream`` on the Rust backend
  tokenizer, primed with the tail of the prompt so context-dependent decoders (a SentencePiece
  leading space, say) see what came before.
- **offset** (any tokenizer with ``decode``; also the fallback if the stream raises): decode a
  small window of tokens already turned into text plus the unread ones, and emit the
  difference once it no longer ends in U+FFFD (an incomplete UTF-8 character).

Neither applies ``clean_up_tokenization_spaces``: text only ever grows at its end, so deltas
are final.

A request that wants only its final text and has no stop strings (``LLM.generate``) decodes
**deferred**: tokens are only collected while it runs, and decoded once, in one call, when it
finishes (or token by token, as above, if its text is read before then: an abort). That is the
same text for a fraction of the per-step cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from octavo.engine.stop_strings import StopStringMatcher, stop_string_matcher
from octavo.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# What a decoder shows for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded before the unread ones, for context (leading spaces, merges across tokens).
_CONTEXT_TOKENS = 6
# Tokens already turned into text are dropped from the buffer once this many pile up.
_TRIM_AT = 64

DecodeFn = Callable[[list[int]], str]


class IncrementalDetokenizer:
    """Text of one completion, built token by token.

    Correct for multi-byte characters split over tokens: no text is produced for a token that
    ends inside a character, until the tokens completing it arrive (or the request finishes).

    Invariants: ``output_text`` only grows at its end, except once, when a stop string is
    found; the deltas returned by ``take_delta`` concatenate to the final ``output_text``
    (text that could still be cut by a stop string is held back until it cannot).
    """

    __slots__ = (
        "_backend",
        "_decode",
        "_deferred",
        "_include_stop",
        "_max_stop_len",
        "_matcher",
        "_num_sent",
        "_read_offset",
        "_skip_special_tokens",
        "_stop_str",
        "_stream",
        "_text",
        "_token_ids",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        defer: bool = False,
    ) -> None:
        """Prepare to decode the completion of ``prompt_token_ids``.

        :param tokenizer: a ``transformers`` tokenizer (fast ones use the streaming decoder),
            a ``tokenizers.Tokenizer``, or any object with
            ``decode(ids, skip_special_tokens=...)``.
        :param prompt_token_ids: the prompt; only its last few tokens are kept, as context.
        :param params: the request's settings; ``stop``, ``include_stop_str_in_output`` and
            ``skip_special_tokens`` are used.
        :param defer: only the final text is wanted: decode when the request finishes, not
            every step. Ignored when ``params`` has stop strings (they must be found as
            tokens arrive).
        """
        self._skip_special_tokens = params.skip_special_tokens
        # The Rust ``tokenizers.Tokenizer`` (fast tokenizers), or None: offset decoding only.
        self._backend = _backend_tokenizer(tokenizer)
        # ids -> text, honouring skip_special_tokens; used by offset decoding.
        self._decode = _decode_fn(tokenizer, self._backend, self._skip_special_tokens)
        # Prompt tail (context) then the completion's tokens, trimmed from the front as we go.
        self._token_ids = _prompt_context(self._decode, prompt_token_ids)
        # Tokens before this index are already part of _text (or are prompt context).
        self._read_offset = len(self._token_ids)
        # The DecodeStream (primed with the context), or None when decoding by offsets.
        self._stream = self._new_stream(self._token_ids) if self._backend is not None else None
        self._text = ""
        # Characters of _text already handed out by take_delta.
        self._num_sent = 0
        # Stop strings (one automaton for all; None: none), and the longest one's length (0:
        # none, nothing held back).
        stops = tuple(params.stop or ())
        self._matcher: StopStringMatcher | None = stop_string_matcher(stops) if stops else None
        self._max_stop_len = self._matcher.max_len if self._matcher is not None else 0
        self._include_stop = params.include_stop_str_in_output
        # The stop string found, once one is.
        self._stop_str: str | None = None
        # Deferred decoding: tokens received but not decoded yet (None: decode every step).
        self._deferred: list[int] | None = [] if defer and self._matcher is None else None

    @property
    def output_text(self) -> str:
        """The completion's text so far (after a stop match: cut at the stop string)."""
        if self._deferred:
            self._decode_deferred_stepwise()
        return self._text

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Append generated tokens, extend the text and look for stop strings in what is new.

        :param new_token_ids: tokens generated since the last call (may be empty).
        :param finished: the request ends with these tokens (EOS, length, ...); bytes still
            waiting for the rest of a character are then decoded as they are (U+FFFD), as
            ``tokenizer.decode`` would.
        :returns: the stop string found, or ``None``. On a match the text is cut before the
            stop string (after it with ``include_stop_str_in_output``) and the caller should
            finish the request with ``stop_reason`` set to it. The earliest match wins; of
            matches starting at the same place, the shortest (the first one token by token
            generation reaches). Tokens given after a match are ignored (async steps may
            still deliver some) and ``None`` is returned.
        """
        if self._stop_str is not None:
            return None
        if self._deferred is not None:
            self._deferred.extend(new_token_ids)
            if finished:
                self._decode_deferred_at_once()
            return None
        old_len = len(self._text)
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            self._extend(self._step(token_id))
        if finished and self._read_offset < len(self._token_ids):
            self._extend(self._offset_text(force=True))
        if len(self._text) > old_len and self._matcher is not None:
            return self._find_stop(old_len)
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; everything when ``finished`` or after a stop match.

        While neither, the last ``max(len(stop)) - 1`` characters are held back: they could
        be the start of a stop string, which would be cut from the text.
        """
        if self._deferred:
            self._decode_deferred_stepwise()
        if finished or self._stop_str is not None:
            end = len(self._text)
        else:
            end = max(self._num_sent, len(self._text) - max(self._max_stop_len - 1, 0))
        delta = self._text[self._num_sent:end]
        self._num_sent = end
        return delta

    # -- decoding ---------------------------------------------------------------------------

    def _decode_deferred_at_once(self) -> None:
        """The request finished: decode every deferred token in one call, as ``update`` would."""
        self._token_ids.extend(self._deferred)
        self._deferred.clear()
        self._extend(self._offset_text(force=True))

    def _decode_deferred_stepwise(self) -> None:
        """Text asked for before the end (an abort): decode deferred tokens one by one, so
        a character still incomplete is held back exactly as in per-step decoding."""
        pending, self._deferred = self._deferred, None
        self.update(pending, finished=False)
        self._deferred = []

    def _new_stream(self, context_ids: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context_ids), skip_special_tokens=self._skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        """New text once ``token_id`` is appended to ``_token_ids``, or None while incomplete."""
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id)
            except Exception as exc:  # e.g. "Invalid prefix" from decoders that rewrite text
                logger.debug("DecodeStream failed (%s); using offset decoding", exc)
                self._stream = None
        return self._offset_text(force=False)

    def _offset_text(self, force: bool) -> str | None:
        """Text the unread tokens add after the last few read ones.

        None while that is nothing or ends in U+FFFD, unless ``force`` (end of the request).
        """
        start = max(0, self._read_offset - _CONTEXT_TOKENS)
        prefix_text = self._decode(self._token_ids[start:self._read_offset])
        full_text = self._decode(self._token_ids[start:])
        incomplete = full_text.endswith(_REPLACEMENT_CHAR)
        if not force and (len(full_text) <= len(prefix_text) or incomplete):
            return None
        return full_text[len(prefix_text):]

    def _extend(self, chunk: str | None) -> None:
        """Append ``chunk``: every token so far is now read."""
        if chunk is None:
            return
        self._text += chunk
        self._read_offset = len(self._token_ids)
        if self._read_offset >= _TRIM_AT:
            drop = self._read_offset - _CONTEXT_TOKENS
            del self._token_ids[:drop]
            self._read_offset -= drop

    # -- stop strings -----------------------------------------------------------------------

    def _find_stop(self, old_len: int) -> str | None:
        """Look for a stop string ending in the text added after ``old_len``; cut on a match."""
        assert self._matcher is not None
        found = self._matcher.find(self._text, old_len)
        if found is None:
            return None
        index, stop = found
        cut = index + len(stop) if self._include_stop else index
        assert cut >= self._num_sent, (
            f"stop string {stop!r} at {index} cuts text already handed out ({self._num_sent} chars)"
        )
        self._text = self._text[:cut]
        self._stop_str = stop
        return stop


def _backend_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``, or None (a slow tokenizer)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers depends on tokenizers
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for name in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


def _decode_fn(tokenizer: Any, backend: Any, skip_special_tokens: bool) -> DecodeFn:
    """A ``decode(ids) -> str`` without clean-up of tokenization spaces."""
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must have a decode(ids) method, got {type(tokenizer).__name__}")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode


def _prompt_context(decode: DecodeFn, prompt_token_ids: list[int]) -> list[int]:
    """The last few prompt tokens, less any that end in an incomplete character.

    Those bytes belong to a character the completion finishes; leaving them out makes the
    completion start with U+FFFD, as ``tokenizer.decode(output_ids)`` would, instead of
    repeating prompt text.
    """
    context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
    while context and decode(context).endswith(_REPLACEMENT_CHAR):
        context.pop()
    return context
