"""``deepseek_r1``: DeepSeek-R1 and its distills (``<think>`` ... ``</think>`` then the answer).

R1's chat template opens the think block in the prompt (``<|Assistant|><think>\\n``), so the
generated text is reasoning from its first character until ``</think>``, whether or not the
model repeats the start tag; text with no end tag (cut by ``max_tokens``) is all reasoning.
"""

from __future__ import annotations

from octavo.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt_opens_reasoning: bool) -> bool:
        return True
