"""``StopStringMatcher``: finds a request's stop strings in its growing text with one
Aho-Corasick automaton (``pyahocorasick``), so the cost per new piece of text depends on how
much text is scanned, not on how many stop strings the request has.

The text grows at its end; after each growth only the last ``max_len - 1`` old characters and
the new ones are scanned (a match must end in the new text, or it would have been found
before). Automata are built once per distinct list of stop strings and cached: many requests
of a server send the same list.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import ahocorasick

# Distinct stop-string lists whose automata are kept.
_CACHE_SIZE = 512


class StopStringMatcher:
    """The stop strings of one request, searchable in one pass."""

    __slots__ = ("_automaton", "max_len")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        automaton = ahocorasick.Automaton()
        for stop in stops:
            automaton.add_word(stop, stop)
        automaton.make_automaton()
        self._automaton = automaton
        # Length of the longest stop string: a match starts at most max_len - 1 characters
        # before the end of the text already searched.
        self.max_len = max(len(s) for s in stops)

    def find(self, text: str, old_len: int) -> tuple[int, str] | None:
        """The first stop string in ``text`` that ends after ``text[:old_len]``.

        ``text[:old_len]`` was searched before (and held no stop string). The match that
        starts first wins; of those starting at the same place, the shortest (the one that
        generation token by token completes first). Returns ``(index, stop string)`` or
        ``None``.
        """
        start = max(0, old_len - self.max_len + 1)
        best: tuple[int, str] | None = None
        # Matches come in order of their end; a match ending past best + max_len - 1 cannot
        # start before best, so the scan stops there.
        for end, stop in self._automaton.iter(text, start):
            index = end - len(stop) + 1
            if best is not None and end - self.max_len + 1 > best[0]:
                break
            if best is None or (index, len(stop)) < (best[0], len(best[1])):
                best = (index, stop)
        return best


@functools.lru_cache(maxsize=_CACHE_SIZE)
def stop_string_matcher(stops: tuple[str, ...]) -> StopStringMatcher:
    """The (cached) matcher of a tuple of stop strings."""
    return StopStringMatcher(stops)
