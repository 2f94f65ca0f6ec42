"""The sampler's structured-output step: token bitmasks applied on the device, per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.sample import DeviceGrammarMasks, GrammarRows, Sampler
from octavo.sample.sampler import unpack_bitmask
from tests.sample.helpers import make_row, random_logits

VOCAB = 100  # not a multiple of 32: the last word is partly padding


def pack(allowed: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """The reference packing: bit t % 32 of int32 word t // 32 set for each allowed t."""
    words = (vocab + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            out[row, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return torch.from_numpy(out.view(np.int32))


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 384])
def test_unpack_matches_the_packing(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    allowed = [sorted(torch.randperm(vocab, generator=gen)[: max(1, vocab // 3)].tolist())
               for _ in range(4)] + [list(range(vocab)), [vocab - 1]]
    mask = unpack_bitmask(pack(allowed, vocab), vocab)
    assert mask.shape == (len(allowed), vocab) and mask.dtype == torch.bool
    for row, tokens in enumerate(allowed):
        assert mask[row].nonzero().flatten().tolist() == tokens


def test_tokens_past_the_bitmask_are_not_allowed() -> None:
    # A model whose logits are wider than the tokenizer's vocabulary (padded embeddings).
    mask = unpack_bitmask(pack([[0, 31]], vocab=32), vocab_size=40)
    assert mask.shape == (1, 40)
    assert mask[0].nonzero().flatten().tolist() == [0, 31]


def test_greedy_rows_take_the_best_allowed_token_and_free_rows_are_untouched() -> None:
    logits = random_logits(4, VOCAB)
    allowed = [[3, 50, 99], [7]]
    grammar = GrammarRows(row_ids=[1, 3], bitmask=pack(allowed))
    rows = [make_row(temperature=0.0) for _ in range(4)]
    tokens = Sampler()(logits, rows, grammar).sampled_token_ids.tolist()
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[2] == logits[2].argmax().item()
    best = max(allowed[0], key=lambda t: logits[1, t].item())
    assert tokens[1] == best
    assert tokens[3] == 7


def test_random_rows_sample_only_allowed_tokens() -> None:
    logits = random_logits(64, VOCAB, scale=3.0)
    allowed = [[1, 2, 3, 64, 99]] * 64
    grammar = GrammarRows(row_ids=list(range(64)), bitmask=pack(allowed))
    rows = [make_row(temperature=1.5, top_p=0.9, logit_bias={4: 50.0}) for _ in range(64)]
    tokens = Sampler()(logits, rows, grammar).sampled_token_ids.tolist()
    assert set(tokens) <= set(allowed[0])
    assert len(set(tokens)) > 1  # still sampled, not collapsed to one token


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    # vLLM's default: logprobs describe the model's distribution, before any processing.
    logits = random_logits(2, VOCAB)
    grammar = GrammarRows(row_ids=[0], bitmask=pack([[5]]))
    rows = [make_row(temperature=0.0, logprobs=2) for _ in range(2)]
    out = Sampler()(logits, rows, grammar)
    expected = torch.log_softmax(logits[0].float(), dim=-1)[5]
    assert out.sampled_token_ids[0].item() == 5
    assert out.logprobs is not None
    assert out.logprobs.token_ids[0, 0].item() == 5
    assert torch.isclose(out.logprobs.logprobs[0, 0], expected, atol=1e-5)


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "row-ids"])
def test_masks_already_on_the_device_sample_as_host_rows_do(every_row: bool) -> None:
    """``DeviceGrammarMasks`` (the runner's staged masks; row ids None: every row, in order)
    give the same tokens as the same rows given as host ``GrammarRows``."""
    logits = random_logits(3, VOCAB, scale=3.0)
    allowed = [[3, 50, 99], [7, 8], [0, 64]] if every_row else [[7, 8], [0, 64]]
    row_ids = [0, 1, 2] if every_row else [1, 2]
    rows = [make_row(temperature=0.0), make_row(temperature=1.0, seed=3),
            make_row(temperature=0.8, top_k=2, seed=4)]
    want = Sampler()(logits, rows, GrammarRows(row_ids=row_ids, bitmask=pack(allowed)))
    staged = DeviceGrammarMasks(row_ids=None if every_row else torch.tensor(row_ids),
                                bitmask=pack(allowed))
    got = Sampler()(logits, rows, staged)
    assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist()
    for row, tokens in zip(row_ids, allowed):
        assert got.sampled_token_ids[row].item() in tokens
