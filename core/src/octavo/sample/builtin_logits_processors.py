"""The logits processors that ship with Octavo, registered through the same hook as a plugin's.

- ``no_repeat_ngram`` (``ngram_size``: int >= 1): no n-gram of the prompt and output appears
  twice, as Hugging Face's ``no_repeat_ngram_size``: a token that would complete an n-gram seen
  before is masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from octavo.hookspecs import hookimpl
from octavo.sample.logits_processor import LogitsProcessor, LogitsProcessorRow
from octavo.transfer import host_to_device


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Masks every token that would repeat an n-gram of the sequence (prompt + output)."""

    @classmethod
    def validate_kwargs(cls, kwargs: dict[str, Any]) -> None:
        if set(kwargs) != {"ngram_size"}:
            raise ValueError(f"takes one argument, ngram_size, got {sorted(kwargs)}")
        size = kwargs["ngram_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"ngram_size must be an integer >= 1, got {size!r}")

    def apply(self, logits: torch.Tensor, rows: list[LogitsProcessorRow]) -> torch.Tensor:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, row in enumerate(rows):
            for token_id in banned_tokens(row.prompt_token_ids + row.output_token_ids,
                                          row.kwargs["ngram_size"]):
                if token_id < self.vocab_size:
                    row_ids.append(i)
                    token_ids.append(token_id)
        if row_ids:
            index = host_to_device(torch.tensor([row_ids, token_ids], dtype=torch.long),
                                   logits.device)
            logits.index_put_((index[0], index[1]), logits.new_full((), float("-inf")))
        return logits


def banned_tokens(tokens: list[int], ngram_size: int) -> set[int]:
    """Tokens that would complete an n-gram already in ``tokens`` after its last n-1 tokens."""
    if len(tokens) + 1 < ngram_size:
        return set()
    prefix = tuple(tokens[len(tokens) - ngram_size + 1:]) if ngram_size > 1 else ()
    banned = set()
    for start in range(len(tokens) - ngram_size + 1):
        if tuple(tokens[start:start + ngram_size - 1]) == prefix:
            banned.add(tokens[start + ngram_size - 1])
    return banned


@hookimpl
def octavo_register_logits_processors(
    register: Callable[[str, type[LogitsProcessor]], None],
) -> None:
    register("no_repeat_ngram", NoRepeatNGramLogitsProcessor)
