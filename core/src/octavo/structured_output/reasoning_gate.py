"""``ReasoningGate``: with ``--reasoning-parser``, a constraint applies to the answer only.

A reasoning model writes ``<think> ... </think>`` before its answer. A structured output (a
JSON schema, a forced tool call) must shape the answer, not the thinking: the grammar stays in
its initial state while the request thinks, and starts with the first token after the end tag.
The gate follows the same rules as the server's text splitter (``ReasoningParser.stream``), so
the part the grammar shaped is exactly the part the server returns as ``content``:

* the prompt ends with a closed think block (thinking switched off, as Qwen3's template does
  with ``enable_thinking=False``): the request **answers** from its first token;
* the prompt left a think block open, or the parser says generated text is always reasoning
  first (``deepseek_r1``): the request **thinks** from its first token until the end tag;
* otherwise the request **may think**: its first token may be the start tag (then it thinks)
  or a token the grammar allows (then it answers, and the grammar has consumed that token).
  The first step's mask is the grammar's mask plus the start tag;
* once the end tag is written, the request **answers** until it ends.

Tags that are one token each are read by id. A tag of several tokens is read by decoding the
last few tokens; a request that may think then answers from its first token (a tag of several
tokens cannot be added to a one-token mask), which the server's splitter also does when the
text does not begin with the start tag.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from octavo.reasoning import ReasoningParser


class Phase(enum.Enum):
    """Where a constrained request is in its output."""

    ANSWERING = "answering"
    THINKING = "thinking"
    MAY_THINK = "may_think"


@dataclass(slots=True)
class GateState:
    """One request's phase, and (tags of several tokens only) its last tokens while thinking."""

    phase: Phase
    tail: list[int] = field(default_factory=list)


class ReasoningGate:
    """Decides, token by token, which of a request's tokens its grammar sees. Read-only after
    construction: one gate serves every request, from any thread."""

    def __init__(self, parser: ReasoningParser, tokenizer: Any) -> None:
        self._parser = parser
        self._tokenizer = tokenizer
        self.start_token_id = parser.start_token_id
        self.end_token_id = parser.end_token_id
        self._single_token_tags = self.start_token_id is not None and self.end_token_id is not None
        # Enough tokens to hold the end tag when it is several tokens long.
        self._tail_len = 2 * len(tokenizer.encode(parser.end_tag, add_special_tokens=False)) + 2

    def initial_state(self, prompt_token_ids: Sequence[int]) -> GateState:
        """The phase of a request before its first token, from its prompt."""
        # The end of the prompt is enough to see a closed block (an end tag, then whitespace).
        prompt_end = self._tokenizer.decode(list(prompt_token_ids[-self._tail_len - 8:]),
                                            skip_special_tokens=False)
        if self._parser.prompt_closes_reasoning(prompt_end):
            return GateState(Phase.ANSWERING)
        opens = self._parser.last_tag(prompt_token_ids) == self._parser.start_tag
        if self._parser.starts_in_reasoning(opens):
            return GateState(Phase.THINKING)
        if self._single_token_tags:
            return GateState(Phase.MAY_THINK)
        return GateState(Phase.ANSWERING)

    def advance(self, state: GateState, token_ids: Sequence[int]) -> list[int]:
        """Move ``state`` over the sampled ``token_ids``; the ones the grammar must consume
        (those after the reasoning ended)."""
        for index, token_id in enumerate(token_ids):
            if state.phase is Phase.ANSWERING:
                return list(token_ids[index:])
            if state.phase is Phase.MAY_THINK:
                if token_id == self.start_token_id:
                    state.phase = Phase.THINKING
                    continue
                state.phase = Phase.ANSWERING
                return list(token_ids[index:])
            if self._ends_reasoning(state, token_id):
                state.phase = Phase.ANSWERING
                state.tail = []
                return list(token_ids[index + 1:])
        return []

    def _ends_reasoning(self, state: GateState, token_id: int) -> bool:
        if self._single_token_tags:
            return token_id == self.end_token_id
        state.tail.append(token_id)
        del state.tail[:-self._tail_len]
        text = self._tokenizer.decode(state.tail, skip_special_tokens=False)
        return self._parser.end_tag in text
