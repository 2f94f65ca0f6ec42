"""``qwen3``: Qwen3 and QwQ (``<think>`` ... ``</think>`` then the answer).

Qwen3's hybrid models write ``<think>`` themselves when thinking, and get an empty, closed
block in the prompt when thinking is off; its "thinking-only" models (and QwQ) get the start
tag in the prompt. So the text is reasoning when it starts with ``<think>`` or when the prompt
left a think block open, and otherwise all answer.
"""

from __future__ import annotations

from octavo.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
