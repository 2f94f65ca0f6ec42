"""``StopStringMatcher``: one automaton finds the same stop string as a search per string."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from octavo.engine.stop_strings import StopStringMatcher, stop_string_matcher

ALPHABET = "ab\u00e9c "  # few letters: stop strings overlap and repeat often


def reference_find(stops: list[str], text: str, old_len: int) -> tuple[int, str] | None:
    """The definition: the match ending after old_len that starts first; then the shortest."""
    best = None
    start = max(0, old_len - max(len(s) for s in stops) + 1)
    for stop in stops:
        index = text.find(stop, start)
        while index != -1 and index + len(stop) <= old_len:  # ends in the old text: skip
            index = text.find(stop, index + 1)
        if index != -1 and (best is None or (index, len(stop)) < (best[0], len(best[1]))):
            best = (index, stop)
    return best


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=8),
    text=st.text(ALPHABET, max_size=40),
    cut=st.integers(min_value=0, max_value=40),
)
def test_matches_the_per_string_search(stops, text, cut):
    old_len = min(cut, len(text))
    # Only texts whose old part holds no stop string are reachable (it was searched before).
    if reference_find(stops, text[:old_len], 0) is not None:
        return
    assert StopStringMatcher(stops).find(text, old_len) == reference_find(stops, text, old_len)


def test_earliest_start_then_shortest():
    matcher = StopStringMatcher(["abcd", "b", "bc"])
    assert matcher.find("xxabcdyy", 0) == (2, "abcd")  # starts first, though "b" ends first
    assert StopStringMatcher(["bc", "b"]).find("abcx", 0) == (1, "b")
    assert matcher.find("xxaxx", 0) is None


def test_only_text_near_the_new_part_is_scanned():
    matcher = StopStringMatcher(["stop"])
    text = "st" + "x" * 10_000 + "op stop"
    assert matcher.find(text, len(text) - 3) == (len(text) - 4, "stop")


def test_matchers_are_cached_per_list():
    assert stop_string_matcher(("a", "b")) is stop_string_matcher(("a", "b"))
