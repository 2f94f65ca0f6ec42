"""The prompt-lookup proposer against a plain-Python reference."""

from __future__ import annotations

import random

from octavo.spec_decode.ngram_proposer import NgramProposer


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix first; the latest earlier match followed by k tokens, else the earliest."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n:]
        starts = [i for i in range(num - n) if tokens[i : i + n] == suffix]
        if starts:
            whole = [i for i in starts if i + n + k <= num]
            start = (whole[-1] if whole else starts[0]) + n
            return tokens[start : start + k]
    return []


def test_examples() -> None:
    proposer = NgramProposer(1, 3, 4)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2]
    assert proposer.propose([1, 2, 3]) == []  # nothing repeats
    assert proposer.propose([9]) == []
    assert proposer.propose([5, 1, 2, 9, 9, 1, 2], max_tokens=2) == [9, 9]
    assert proposer.propose([5, 1, 2, 9, 9, 1, 2], max_tokens=0) == []
    # The longest suffix wins over a more recent shorter match.
    assert NgramProposer(1, 2, 1).propose([7, 8, 1, 3, 8, 2, 7, 8]) == [1]
    # min_n bounds the lookup: a single repeated token is not enough for n = 2.
    assert NgramProposer(2, 2, 3).propose([4, 5, 6, 7, 5]) == []


def test_repeating_tail_proposes_whole_period_runs() -> None:
    # In a period-2 tail the latest match would be followed by 2 tokens only.
    assert NgramProposer(2, 2, 4).propose([1, 2, 1, 2, 1, 2, 1, 2]) == [1, 2, 1, 2]
    assert NgramProposer(1, 1, 3).propose([7] * 6) == [7, 7, 7]


def test_matches_reference_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert NgramProposer(min_n, max_n, k).propose(tokens) == _reference(tokens, min_n, max_n, k)


def test_kept_tokens_per_key_give_the_same_drafts() -> None:
    rng = random.Random(1)
    proposer = NgramProposer(1, 3, 4)
    tokens: list[int] = []
    for _ in range(200):
        tokens += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        assert proposer.propose(tokens, key="a") == _reference(tokens, 1, 3, 4)
    proposer.forget("a")
    assert proposer._buffers == {}
    # A key whose tokens got shorter (not an extension) starts again.
    assert proposer.propose([1, 2, 1, 5], key="b") == []
    assert proposer.propose([3, 4, 3], key="b") == [4, 3]
