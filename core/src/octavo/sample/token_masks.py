"""Token masks of one step: ``allowed_token_ids`` and ``bad_words``, batched on the device.

- ``allowed_token_ids``: every other token of the row gets ``-inf`` (one boolean mask for the
  rows that have such a list, filled with one scatter);
- ``bad_words``: each bad word is a token sequence (``SamplingParams.bad_words_token_ids``,
  tokenized by the front end with and without a leading space); its last token gets ``-inf``
  when the row's generated tokens end with the others (a one-token word: always). The host only
  compares the last few generated tokens with each word; the masking is one ``index_put_``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from octavo.transfer import host_to_device

if TYPE_CHECKING:
    from octavo.sample.metadata import SamplingRow


@dataclass(slots=True)
class TokenMasks:
    """Masks of one step; a ``None`` pair means no row uses that mask."""

    # [num_allowed_rows] int64 rows with allowed_token_ids, and [num_allowed_rows, vocab] bool:
    # True where the token is NOT allowed.
    allowed_row_ids: torch.Tensor | None
    disallowed: torch.Tensor | None
    # [num_banned] int64 each: (row, token) pairs banned this step by bad_words.
    banned_row_ids: torch.Tensor | None
    banned_token_ids: torch.Tensor | None

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int,
                  device: torch.device | str) -> TokenMasks | None:
        """The masks of ``rows`` (``None`` when no row has allowed_token_ids or bad words)."""
        allowed_rows: list[int] = []
        allowed_flat: list[int] = []  # row position among allowed rows, then token ids
        allowed_tokens: list[int] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if params.allowed_token_ids is not None:
                position = len(allowed_rows)
                allowed_rows.append(i)
                for token_id in params.allowed_token_ids:
                    if token_id < vocab_size:
                        allowed_flat.append(position)
                        allowed_tokens.append(token_id)
            for word in params.bad_words_token_ids or []:
                prefix_len = len(word) - 1
                output = row.output_token_ids
                if prefix_len == 0 or (
                        len(output) >= prefix_len and output[len(output) - prefix_len:] == word[:-1]):
                    if word[-1] < vocab_size:
                        banned_rows.append(i)
                        banned_tokens.append(word[-1])
        if not allowed_rows and not banned_rows:
            return None
        ids = host_to_device(torch.tensor(
            allowed_rows + allowed_flat + allowed_tokens + banned_rows + banned_tokens,
            dtype=torch.long), device)
        a, f = len(allowed_rows), len(allowed_flat)
        b = len(banned_rows)
        allowed_row_ids = disallowed = None
        if allowed_rows:
            allowed_row_ids = ids[:a]
            disallowed = torch.ones(a, vocab_size, dtype=torch.bool, device=ids.device)
            disallowed[ids[a:a + f], ids[a + f:a + 2 * f]] = False
        banned = ids[a + 2 * f:]
        return cls(
            allowed_row_ids=allowed_row_ids,
            disallowed=disallowed,
            banned_row_ids=banned[:b] if b else None,
            banned_token_ids=banned[b:] if b else None,
        )


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks | None) -> None:
    """Set the masked tokens of ``logits`` [batch, vocab] to ``-inf``, in place."""
    if masks is None:
        return
    if masks.allowed_row_ids is not None:
        assert masks.disallowed is not None
        rows = logits.index_select(0, masks.allowed_row_ids)
        rows.masked_fill_(masks.disallowed, float("-inf"))
        logits.index_copy_(0, masks.allowed_row_ids, rows)
    if masks.banned_row_ids is not None:
        assert masks.banned_token_ids is not None
        logits.index_put_((masks.banned_row_ids, masks.banned_token_ids),
                          logits.new_full((), float("-inf")))
