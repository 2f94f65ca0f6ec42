"""Prompt-lookup ("ngram") proposer: guess the next tokens by finding the request's last few
tokens earlier in its own prompt and output, and proposing what followed them there.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` tokens are
looked for in the tokens before them (numpy, one vectorised comparison per ``n``). The most
recent earlier match that is followed by ``k`` known tokens wins (in a repeating tail the
latest match would be followed by one period only), else the earliest match; the up to ``k``
tokens that followed it are the draft.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Stateless prompt-lookup proposer.

    :param prompt_lookup_min: shortest suffix looked up (>= 1).
    :param prompt_lookup_max: longest suffix looked up (>= prompt_lookup_min).
    :param num_speculative_tokens: most tokens proposed (k).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, "checked by SpeculativeConfig"
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens to follow ``token_ids`` (prompt + output);
        ``[]`` when no suffix of length ``min_n .. max_n`` occurred before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = tokens.shape[0]
        if k <= 0 or num < self.min_n + 1:
            return []
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = tokens[num - n:]
            # Windows starting at 0 .. num - n - 1: every occurrence that ends before the
            # suffix's last token (so at least one token follows it).
            windows = sliding_window_view(tokens[: num - 1], n)  # [num - n, n]
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                whole = matches[matches + n + k <= num]
                start = int(whole[-1] if whole.size else matches[0]) + n
                return tokens[start : start + k].tolist()
        return []
