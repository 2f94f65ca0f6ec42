"""The per-request numbers a pure-decode step needs, in persistent numpy arrays.

In a step where every scheduled request runs one token (no new request, fork, draft or prompt
logprobs: the steady decode of a large batch), each request's input is its last token (or the
token the step in flight is sampling for it), at position ``num_computed_tokens``, in the slot
its block table gives. ``ModelRunner`` then builds the step's flat batch from these arrays with
a few vectorised operations instead of a Python loop over the requests (vLLM's ``InputBatch``
keeps the same kind of arrays). The arrays are indexed by the request's ``BlockTable`` row,
which it keeps from its first step to its last.

Contract, for the live request that owns ``row``:

- ``num_tokens[row]`` is ``len(token_ids)`` and ``last_token[row]`` is ``token_ids[-1]`` (the
  runner's ``CachedRequestState.token_ids``): set by ``claim`` when the request gets the row
  and by ``sync`` / ``append_sampled`` whenever its tokens change;
- ``sampled_row[row]`` is its row in the sampled-token tensor of the last step that sampled
  for it (its next input while that token is not on the host yet);
- ``epoch[row]`` changes every time the row gets a new owner: a step whose tokens come back
  after its request was forgotten (async scheduling) must not touch the row's next owner.
"""

from __future__ import annotations

import numpy as np


class DecodeRows:
    """Arrays of ``num_tokens``, ``last_token``, ``sampled_row`` and ``epoch`` per row."""

    def __init__(self, num_rows: int) -> None:
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.last_token = np.zeros(num_rows, dtype=np.int64)
        self.sampled_row = np.full(num_rows, -1, dtype=np.int64)
        self.epoch = np.zeros(num_rows, dtype=np.int64)
        # Rows claimed so far (when it has not changed, no row changed owner).
        self.num_claims = 0

    def claim(self, row: int, token_ids: list[int]) -> None:
        """``row`` now belongs to a request holding ``token_ids``."""
        if row >= len(self.num_tokens):
            self._grow(row + 1)
        self.epoch[row] += 1
        self.num_claims += 1
        self.sampled_row[row] = -1
        self.sync(row, token_ids)

    def sync(self, row: int, token_ids: list[int]) -> None:
        """The request on ``row`` now holds ``token_ids``."""
        self.num_tokens[row] = len(token_ids)
        self.last_token[row] = token_ids[-1] if token_ids else 0

    def append_sampled(self, rows: np.ndarray, epochs: np.ndarray, num_claims: int,
                       tokens: np.ndarray) -> None:
        """Token ``tokens[i]`` was appended to the request on ``rows[i]``, when that row's
        owner is still the one of ``epochs[i]``; ``epochs`` and ``num_claims`` were read
        together, when the tokens were launched (rows are distinct)."""
        if num_claims != self.num_claims:  # some row may have a new owner
            same = self.epoch[rows] == epochs
            rows, tokens = rows[same], tokens[same]
        self.num_tokens[rows] += 1
        self.last_token[rows] = tokens

    def _grow(self, num_rows: int) -> None:
        size = max(num_rows, 2 * len(self.num_tokens))
        for name in ("num_tokens", "last_token", "sampled_row", "epoch"):
            old = getattr(self, name)
            grown = np.full(size, -1 if name == "sampled_row" else 0, dtype=np.int64)
            grown[: len(old)] = old
            setattr(self, name, grown)
