"""``ReasoningParser``: splits what a reasoning model writes into its thinking and its answer.

Reasoning models write their thinking between two tags (``<think>`` ... ``</think>``) before
the answer. A parser has two faces:

* **text** (the OpenAI server): ``stream(prompt)`` gives a ``ReasoningStream`` that takes the
  generated text piece by piece and says which part of each piece is reasoning and which is
  answer; ``split(text, prompt)`` does the same for a whole text, through the same code, so a
  streamed response always adds up to the non-streamed one.
* **tokens** (the engine): ``start_token_id``/``end_token_id`` (tags that are one token each)
  and ``is_reasoning_end(token_ids)`` read token sequences, so that a constraint on the answer
  (structured outputs) starts right after the end tag (``octavo.structured_output.
  reasoning_gate``, which follows the text rules above).

Whitespace that separates the parts is not part of either: the reasoning is stripped, and the
answer loses its leading whitespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(slots=True)
class ReasoningDelta:
    """What one piece of generated text adds to each part."""

    # Text of the thinking (tags excluded).
    reasoning: str = ""
    # Text of the answer.
    content: str = ""


# Where a ``ReasoningStream`` is.
_START, _REASONING, _AFTER_END, _CONTENT = "start", "reasoning", "after_end", "content"


class ReasoningStream:
    """One completion's text, split incrementally into reasoning and answer.

    ``feed(piece)`` returns what can be told of each part so far; a tag cut in two between
    pieces, or whitespace that may end the reasoning, is held back until the next piece (or
    ``finish()``) decides.
    """

    def __init__(self, start_tag: str, end_tag: str, starts_in_reasoning: bool,
                 answer_only: bool = False) -> None:
        self._start_tag = start_tag
        self._end_tag = end_tag
        # Whether the text is reasoning from its first character (the prompt opened the block).
        self._starts_in_reasoning = starts_in_reasoning
        # The prompt ended with a closed think block (thinking switched off): all answer.
        self._state = _CONTENT if answer_only else _START
        # Text received and not yet given out.
        self._buffer = ""
        # Whitespace at the end of the reasoning so far: given out only if more reasoning follows.
        self._held_space = ""
        # The reasoning has begun (its leading whitespace is dropped until then).
        self._reasoning_begun = False

    @property
    def in_reasoning(self) -> bool:
        """True while the text is (or may still be) reasoning."""
        return self._state in (_START, _REASONING)

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        delta = ReasoningDelta()
        while self._step(delta, final=False):
            pass
        return delta

    def finish(self) -> ReasoningDelta:
        """The text has ended: give out everything held back."""
        delta = ReasoningDelta()
        while self._step(delta, final=True):
            pass
        if self._state == _START:  # only whitespace, or part of a start tag, came
            self._state = _REASONING if self._starts_in_reasoning else _CONTENT
            self._step(delta, final=True)
        if self._state == _REASONING:
            self._reason(delta, self._buffer)
            self._buffer = ""
        elif self._state == _CONTENT:
            delta.content += self._buffer
            self._buffer = ""
        return delta

    # ---- the state machine -----------------------------------------------------------------

    def _step(self, delta: ReasoningDelta, final: bool) -> bool:
        """Consume what the buffer allows; True when the state changed (call again)."""
        if self._state == _START:
            return self._step_start(final)
        if self._state == _REASONING:
            return self._step_reasoning(delta)
        if self._state == _AFTER_END:
            stripped = self._buffer.lstrip()
            self._buffer = stripped
            if stripped:
                self._state = _CONTENT
                return True
            return False
        delta.content += self._buffer
        self._buffer = ""
        return False

    def _step_start(self, final: bool) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(self._start_tag):
            self._buffer = body[len(self._start_tag):]
            self._state = _REASONING
            return True
        if not body or (self._start_tag.startswith(body) and not final):
            return False  # undecided: wait for more text
        self._state = _REASONING if self._starts_in_reasoning else _CONTENT
        return True

    def _step_reasoning(self, delta: ReasoningDelta) -> bool:
        end = self._buffer.find(self._end_tag)
        if end >= 0:
            self._reason(delta, self._buffer[:end], ending=True)
            self._buffer = self._buffer[end + len(self._end_tag):]
            self._state = _AFTER_END
            return True
        keep = _partial_suffix(self._buffer, self._end_tag)
        self._reason(delta, self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _reason(self, delta: ReasoningDelta, text: str, ending: bool = False) -> None:
        """Give out ``text`` as reasoning, minus the whitespace around the whole reasoning."""
        if not self._reasoning_begun:
            text = text.lstrip()
            if not text:
                return
            self._reasoning_begun = True
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = "" if ending else text[len(body):]
        delta.reasoning += body


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Base of the think-tag reasoning parsers; one instance per tokenizer (cheap to make).

    Subclasses set ``name``, the tags if they differ, and ``starts_in_reasoning``.
    """

    # Name given to ``--reasoning-parser``.
    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        # Ids of the tags when each is one token of the vocabulary (None otherwise, or with no
        # tokenizer): token sequences are then read by id, else by decoding.
        self.start_token_id = _single_token_id(tokenizer, self.start_tag)
        self.end_token_id = _single_token_id(tokenizer, self.end_tag)

    def starts_in_reasoning(self, prompt_opens_reasoning: bool) -> bool:
        """Whether generated text is reasoning from its first character, given whether the
        prompt ends inside an open think block (its last tag is a start tag)."""
        return prompt_opens_reasoning

    # ---- text ------------------------------------------------------------------------------

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """True when the prompt's last think tag is a start tag (the template opened the block)."""
        return prompt.rfind(self.start_tag) > prompt.rfind(self.end_tag)

    def prompt_closes_reasoning(self, prompt: str) -> bool:
        """True when the prompt ends with an end tag (and whitespace): the template closed an
        empty think block, as Qwen3's does with ``enable_thinking=False``; everything
        generated is then answer."""
        return prompt.rstrip().endswith(self.end_tag)

    def stream(self, prompt: str = "") -> ReasoningStream:
        """A splitter for one completion of ``prompt``."""
        return ReasoningStream(self.start_tag, self.end_tag,
                               self.starts_in_reasoning(self.prompt_opens_reasoning(prompt)),
                               answer_only=self.prompt_closes_reasoning(prompt))

    def split(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole completion; None for a part that is empty (the
        content is ``""``, not None, when no reasoning was found either)."""
        stream = self.stream(prompt)
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        content = first.content + last.content
        if not reasoning:
            return None, content
        return reasoning, content or None

    # ---- tokens (for the engine) -----------------------------------------------------------

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over at the end of ``token_ids`` (a prompt, or a prompt
        followed by what was generated so far): its last think tag is an end tag.

        With no tag at all the answer is taken as not begun; an engine constraining the answer
        therefore waits for an end tag.
        """
        return self.last_tag(token_ids) == self.end_tag

    def last_tag(self, token_ids: Sequence[int]) -> str | None:
        """The think tag that comes last in ``token_ids`` (``start_tag`` or ``end_tag``), None
        when there is none. Tags that are one token each are found by id; otherwise the ids
        are decoded."""
        if self.end_token_id is not None and self.start_token_id is not None:
            for token_id in reversed(token_ids):
                if token_id == self.end_token_id:
                    return self.end_tag
                if token_id == self.start_token_id:
                    return self.start_tag
            return None
        if self.tokenizer is None:
            raise ValueError(f"reasoning parser {self.name!r} needs a tokenizer to read token ids")
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        start, end = text.rfind(self.start_tag), text.rfind(self.end_tag)
        if start < 0 and end < 0:
            return None
        return self.end_tag if end > start else self.start_tag


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    if tokenizer is None:
        return None
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # a tokenizer that cannot encode the tag: read by decoding instead
        return None
    return ids[0] if len(ids) == 1 else None
