"""``LogprobsLists``: logprobs of consecutive positions, as plain lists (msgpack-able)."""

from __future__ import annotations

import msgspec


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs of consecutive positions: row i = [chosen token, top-k tokens...]."""

    # [num_positions][1 + k] token ids; column 0 is the chosen (sampled or actual) token.
    token_ids: list[list[int]]
    # [num_positions][1 + k] log-probabilities matching token_ids.
    logprobs: list[list[float]]
    # [num_positions] rank of the chosen token (1 = most likely).
    ranks: list[int]

    def head(self, num_positions: int) -> LogprobsLists:
        """The first ``num_positions`` positions (a stop cut a step's tokens short)."""
        return LogprobsLists(self.token_ids[:num_positions], self.logprobs[:num_positions],
                             self.ranks[:num_positions])
