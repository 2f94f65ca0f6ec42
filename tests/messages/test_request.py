"""``Request``: the one-call append-and-stop-check of the scheduler's common row is exactly
``append_output_token`` then ``check_stop``, and block hashes are kept up to date whether the
hasher is called after every token or only when a block fills."""

from __future__ import annotations

import itertools

import pytest
from octavo.kv_cache.hashing import block_hasher, extend_block_hashes
from octavo.messages import Request, RequestStatus
from octavo.sampling_params import SamplingParams

BS = 4


def _pair(params: SamplingParams, prompt: list[int], hasher) -> tuple[Request, Request]:
    return (Request("a", prompt, params, block_hasher=hasher),
            Request("b", prompt, params, block_hasher=hasher))


@pytest.mark.parametrize("ignore_eos, min_tokens, stop_token_ids", itertools.product(
    [False, True], [0, 3], [None, [7], [2, 7]]))
def test_append_token_and_check_stop_is_append_then_check_stop(
        ignore_eos: bool, min_tokens: int, stop_token_ids: list[int] | None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=ignore_eos,
                            min_tokens=min_tokens, stop_token_ids=stop_token_ids,
                            all_stop_token_ids={2})
    tokens = [5, 2, 7, 6, 2, 7, 1, 9, 3, 4, 8]  # EOS (2) and a stop id (7) early and late
    for max_model_len in (12, 30):
        for start in range(len(tokens)):
            fast, slow = _pair(params, [1, 1, 3], block_hasher(BS))
            sequence = tokens[start:] + tokens[:start]
            for token in sequence:
                got = fast.append_token_and_check_stop(token, max_model_len)
                slow.append_output_token(token)
                want = slow.check_stop(max_model_len)
                assert got == want, (sequence, token)
                assert (fast.status, fast.stop_reason) == (slow.status, slow.stop_reason)
                assert fast.block_hashes == slow.block_hashes
                assert fast.all_token_ids == slow.all_token_ids
                if want:
                    break


def test_block_hashes_follow_every_token_and_forks() -> None:
    request = Request("a", [3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True),
                      block_hasher=block_hasher(BS))
    every_token: list = []  # a hasher called after every token (it returns None)

    def hash_always(hashes, token_ids):
        extend_block_hashes(hashes, token_ids, BS)

    other = Request("b", [3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True),
                    block_hasher=hash_always)
    for token in range(10, 30):
        request.append_output_token(token)
        other.append_token_and_check_stop(token, 100)
        expected: list = []
        extend_block_hashes(expected, request.all_token_ids, BS)
        assert request.block_hashes == expected == other.block_hashes
        every_token.append(len(expected))
    assert every_token[-1] == 23 // BS
    child = request.fork("c")
    for token in range(30, 40):
        child.append_output_token(token)
    expected = []
    extend_block_hashes(expected, child.all_token_ids, BS)
    assert child.block_hashes == expected and len(expected) == 33 // BS
    assert request.status == RequestStatus.WAITING
