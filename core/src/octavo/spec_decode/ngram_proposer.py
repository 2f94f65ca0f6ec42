"""Prompt-lookup ("ngram") proposer: guess the next tokens by finding the request's last few
tokens earlier in its own prompt and output, and proposing what followed them there.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` tokens are
looked for in the tokens before them (numpy: one pass over the sequence for the last token,
then one comparison per extra token over the candidate positions only). The most
recent earlier match that is followed by ``k`` known tokens wins (in a repeating tail the
latest match would be followed by one period only), else the earliest match; the up to ``k``
tokens that followed it are the draft.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Prompt-lookup proposer. With ``key`` (a request id) it keeps the request's tokens as a
    numpy array between calls and copies only the tokens appended since (converting a long
    Python list each step would cost more than the lookup); ``forget(key)`` drops it.

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
        # Per key: a buffer holding the tokens seen so far (capacity doubles) and their count.
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def forget(self, key: str) -> None:
        self._buffers.pop(key, None)

    def _as_array(self, token_ids: list[int], key: str) -> np.ndarray:
        """``token_ids`` as int64; the caller only ever appends to a key's tokens."""
        buffer, num_seen = self._buffers.get(key, (np.empty(0, dtype=np.int64), 0))
        num = len(token_ids)
        if num < num_seen:
            num_seen = 0  # not an extension of what was seen: start again
        if num > buffer.shape[0]:
            grown = np.empty(max(num, 2 * buffer.shape[0], 64), dtype=np.int64)
            grown[:num_seen] = buffer[:num_seen]
            buffer = grown
        buffer[num_seen:num] = token_ids[num_seen:]
        self._buffers[key] = (buffer, num)
        return buffer[:num]

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None,
                key: str | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens to follow ``token_ids`` (prompt + output);
        ``[]`` when no suffix of length ``min_n .. max_n`` occurred before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if key is not None and isinstance(token_ids, list):
            tokens = self._as_array(token_ids, key)
        else:
            tokens = np.asarray(token_ids, dtype=np.int64)
        num = tokens.shape[0]
        if k <= 0 or num < self.min_n + 1:
            return []
        # Positions e < num - 1 holding the last token: the ends of candidate matches. Each
        # candidate's match grows backwards while it agrees with the suffix (one vectorised
        # comparison per extra token, over the candidates only).
        ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])
        lengths = np.ones(ends.shape[0], dtype=np.int64)
        alive = ends.copy()
        for n in range(2, min(self.max_n, num - 1) + 1):
            alive = alive[alive - n + 1 >= 0]
            if alive.size == 0:
                break
            alive = alive[tokens[alive - n + 1] == tokens[num - n]]
            lengths[np.searchsorted(ends, alive)] = n
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            matches = ends[lengths >= n] - n + 1  # window starts, ascending
            if matches.size:
                whole = matches[matches + n + k <= num]
                start = int(whole[-1] if whole.size else matches[0]) + n
                return tokens[start : start + k].tolist()
        return []
